"""The GPT-2 model presets (shapes only): torch- and transformers-free, so `train`/`up` check `--preset` and
`--seq-len` before the heavy imports. trainer.models.gpt2 builds the models."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import GPT2Config

GPT2_VOCAB_SIZE = 50257


@dataclass(frozen=True)
class GPT2Preset:
    """Shape of one GPT-2 family member (all presets: vocab 50257, tied embeddings, no dropout).

    Dropout is 0 because zeroth-order probes compare losses at nearby weights and need a forward pass
    that is a deterministic function of (weights, batch).
    """

    name: str
    n_layer: int
    n_head: int
    n_embd: int
    n_positions: int = 1024
    vocab_size: int = GPT2_VOCAB_SIZE
    initializer_range: float = 0.02

    def config(self) -> GPT2Config:
        """Return the `transformers.GPT2Config` for this preset (SDPA attention, dropout 0, tied)."""
        from transformers import GPT2Config

        cfg = GPT2Config(
            vocab_size=self.vocab_size, n_positions=self.n_positions, n_embd=self.n_embd,
            n_layer=self.n_layer, n_head=self.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            initializer_range=self.initializer_range, tie_word_embeddings=True,
        )
        cfg._attn_implementation = "sdpa"
        return cfg

    def num_params(self) -> int:
        """Closed-form count of distinct parameters (tied lm_head counted once).

        V*D + P*D (token and position embeddings) + L*(12*D^2 + 13*D) (per block: ln_1 2D, c_attn
        3D^2+3D, attn c_proj D^2+D, ln_2 2D, c_fc 4D^2+4D, mlp c_proj 4D^2+D) + 2*D (ln_f).
        """
        d = self.n_embd
        return self.vocab_size * d + self.n_positions * d + self.n_layer * (12 * d * d + 13 * d) + 2 * d


PRESETS: dict[str, GPT2Preset] = {
    p.name: p
    for p in (
        # 3,432,896 params, 3,216,448 of them (94%) the tied token embedding: CPU tests and demos.
        GPT2Preset("gpt2-tiny", n_layer=4, n_head=4, n_embd=64, n_positions=256),
        GPT2Preset("gpt2-small", n_layer=12, n_head=12, n_embd=768),  # 124,439,808
        GPT2Preset("gpt2-medium", n_layer=24, n_head=16, n_embd=1024),  # 354,823,168
        GPT2Preset("gpt2-large", n_layer=36, n_head=20, n_embd=1280),  # 774,030,080
        GPT2Preset("gpt2-xl", n_layer=48, n_head=25, n_embd=1600),  # 1,557,611,200
    )
}


def get_preset(preset: str) -> GPT2Preset:
    """Look up a preset by name.

    Raises:
        ValueError: unknown name (the message lists the valid ones).
    """
    if not isinstance(preset, str) or preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; valid presets: {', '.join(PRESETS)}")
    return PRESETS[preset]
