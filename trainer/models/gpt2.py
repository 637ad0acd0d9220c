"""GPT-2 model presets and a deterministic, RNG-neutral `build_model`.

Initialisation follows GPT-2 (Radford et al. 2019, sec. 2.3) as implemented by Hugging Face's
`GPT2PreTrainedModel._init_weights`: weights and embeddings ~ N(0, 0.02^2), the two residual output
projections (`attn.c_proj`, `mlp.c_proj`) ~ N(0, (0.02 / sqrt(2 * n_layer))^2), biases 0, LayerNorm
gain 1. Each tensor is drawn from its own `torch.Generator` seeded by sha256(seed, parameter name), so
a parameter's initial value depends only on (seed, name) — not on the build order, the device or the
global RNG, which is left untouched.
"""

from __future__ import annotations

import hashlib
import math

import torch
from transformers import GPT2LMHeadModel

from trainer.models.params import canonical_parameters
from trainer.models.presets import GPT2_VOCAB_SIZE, PRESETS, GPT2Preset, get_preset

__all__ = ["GPT2_VOCAB_SIZE", "PRESETS", "GPT2Preset", "build_model", "get_preset", "init_gpt2_weights_", "init_std", "param_seed"]

# The presets and their table live torch-free in trainer.models.presets (option checks read them before the heavy
# imports); re-exported here, their historical home.


def param_seed(seed: int, name: str) -> int:
    """Per-parameter generator seed: first 8 bytes of sha256(f"{seed}:{name}"), big-endian, < 2**63."""
    digest = hashlib.sha256(f"{int(seed)}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


def init_std(name: str, n_layer: int, initializer_range: float = 0.02) -> float | None:
    """GPT-2 init std for parameter `name`; None for biases/LayerNorm (set to constants instead)."""
    if name.endswith(".bias") or ".ln_" in name:
        return None
    if name.endswith("c_proj.weight"):
        return initializer_range / math.sqrt(2 * n_layer)
    return initializer_range


@torch.no_grad()
def init_gpt2_weights_(model: GPT2LMHeadModel, seed: int) -> None:
    """Overwrite every parameter of `model` with the seeded GPT-2 init (see module docstring).

    Values are drawn in float32 on the CPU and copied (rounded once) into each parameter's dtype and
    device, so a bf16 or CUDA build equals the fp32 CPU build rounded. Touches no global RNG.
    """
    n_layer = model.config.n_layer
    for name, p in canonical_parameters(model):
        std = init_std(name, n_layer, model.config.initializer_range)
        if std is None:
            p.fill_(1.0 if (".ln_" in name and name.endswith(".weight")) else 0.0)
            continue
        gen = torch.Generator(device="cpu").manual_seed(param_seed(seed, name))
        p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=gen))


def build_model(
    preset: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> GPT2LMHeadModel:
    """Build a GPT-2 preset with deterministic weights, in eval mode.

    Args:
        preset: a key of `PRESETS` ("gpt2-tiny", "gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl").
        seed: init seed; same (preset, seed) gives bit-identical weights on every run and device.
        dtype: parameter dtype (float32 master weights, or bfloat16/float16 for probe copies).
        device: target device; "meta" builds shapes only (no memory, no init) for counting.

    Returns:
        `GPT2LMHeadModel` with `lm_head.weight` tied to `transformer.wte.weight`. Forward takes
        input_ids (B, T) int64 with T <= n_positions and returns logits (B, T, vocab_size).

    Raises:
        ValueError: unknown preset. TypeError: dtype is not a floating torch.dtype.
    """
    spec = get_preset(preset)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype (e.g. torch.float32), got {dtype!r}")
    # Build on the meta device (no allocation, no RNG draws), then materialise and init explicitly.
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = GPT2LMHeadModel(spec.config()).to(dtype)
    # transformers derives loss_type from the class name, which "GPT2LMHeadModel" does not match;
    # name it so labels= uses the standard shifted causal-LM cross-entropy without a warning.
    model.loss_type = "ForCausalLM"
    if torch.device(device).type != "meta":
        model.to_empty(device=device)
        model.tie_weights()  # to_empty allocates wte and lm_head separately; re-share them
        init_gpt2_weights_(model, seed)
    model.eval()
    return model
