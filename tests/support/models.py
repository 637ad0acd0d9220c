"""Tiny GPT-2 models for tests: dropout off, deterministic GPT-2 initialisation from an explicit seed."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from trainer.models.gpt2 import init_gpt2_weights_


def tiny_gpt2(*, vocab_size: int = 128, n_positions: int = 64, n_embd: int = 32, n_layer: int = 2,
              n_head: int = 2, seed: int = 0) -> GPT2LMHeadModel:
    """A GPT2LMHeadModel (float32, CPU, eval mode) of the given shape, weights from `init_gpt2_weights_(seed)`.

    The global RNG is left as it was (transformers' own init draws from it inside fork_rng and is overwritten).
    """
    cfg = GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                     n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                     eos_token_id=0)
    with torch.random.fork_rng(devices=[]):
        model = GPT2LMHeadModel(cfg)
    init_gpt2_weights_(model, seed)
    return model.eval()


def tiny_llama_dir(folder, vocab: int, seed: int):
    """A one-layer Llama (hidden 16, `vocab` ids, tied embeddings) saved into `folder` (save_pretrained), weights
    drawn from `seed` (the global RNG left as it was); returns `folder`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=True, eos_token_id=0, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def student_teacher_and_data(tmp_path):
    """Two tiny Llama folders of one 400-word tokenizer (student seed 0, teacher seed 1) and real text in
    tmp_path/data; returns (student, teacher)."""
    import shutil

    from support.user_data import hf_tokenizer_dir, real_documents

    student = tiny_llama_dir(hf_tokenizer_dir(tmp_path / "student", vocab_size=400), 400, 0)
    teacher = tmp_path / "teacher"
    shutil.copytree(student, teacher)
    for f in teacher.glob("*.safetensors"):
        f.unlink()
    tiny_llama_dir(teacher, 400, 1)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "docs.txt").write_text("\n\n".join(real_documents()))
    return student, teacher
