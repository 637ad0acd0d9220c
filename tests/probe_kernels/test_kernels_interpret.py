"""Triton kernels under TRITON_INTERPRET=1 (CPU) equal the PyTorch reference bit for bit.

The interpreter must be chosen before triton.jit decorates the kernels, so the check runs in a fresh
subprocess with the env var set (probe_kernels.parity covers both dists, seeds >= 2**32 and >= 2**63, odd sizes,
nonzero offsets, fp32/bf16/fp16, in-place axpy, replay and the single-launch list kernels).
"""

import os
import subprocess
import sys

from support.paths import ROOT


def test_interpreted_triton_matches_reference_bit_for_bit():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "probe_kernels.parity"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "parity on cpu (scale 1): OK" in proc.stdout


def test_launchers_reject_bad_inputs_in_interpreter():
    code = """
import torch
from probe_kernels import triton_kernels as tk
checks = [
    (lambda: tk.perturb_triton(torch.zeros(8, dtype=torch.int32), 1, 0, 1.0, 'gauss8'), TypeError),
    (lambda: tk.perturb_triton(torch.zeros(8, 2).t(), 1, 0, 1.0, 'gauss8'), ValueError),
    (lambda: tk.perturb_triton(torch.zeros(8), 1, 0, 1.0, 'gauss8', out=torch.zeros(9)), ValueError),
    (lambda: tk.perturb_triton(torch.zeros(8), -3, 0, 1.0, 'gauss8'), ValueError),
    (lambda: tk.replay_triton(torch.zeros(8), torch.zeros(2), torch.zeros(2), 0, 'gauss8'), TypeError),
    (lambda: tk.perturb_list_triton([torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16)], [0, 4], 1, 1.0,
                                    'gauss8', [torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16)]), ValueError),
]
for fn, exc in checks:
    try:
        fn()
    except exc as e:
        print('ok', type(e).__name__, e)
    else:
        raise SystemExit('no error raised')
"""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok ") == 6
