"""What the stand-in engine tests share: a tiny Llama config (benchmarks/serving_standin.py serves it)."""

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 256,
          "max_position_embeddings": 1024, "tie_word_embeddings": True}
