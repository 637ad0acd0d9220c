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
