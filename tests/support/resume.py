"""Checks for interrupt-then-resume tests (conftest.py's `fail_at_step` does the interrupting)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file


def assert_same_checkpoints(a: Path, b: Path) -> list[str]:
    """Assert that run folders `a` and `b` hold bit-identical checkpoint.safetensors (same keys, every tensor
    torch.equal); return the keys."""
    ta, tb = load_file(str(a / "checkpoint.safetensors")), load_file(str(b / "checkpoint.safetensors"))
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k
    return sorted(ta)
