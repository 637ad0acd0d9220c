"""`python3 -m experiments.gpu_runs.kernels_tuned OUT.json` (one device call): tune the probe kernels' launch
options for gpt2-small (probe_kernels.tune), check parity with them, then run the kernel benchmark (gpt2-small,
gpt2-large) with them and write its JSON to OUT.json."""

import json
import sys

from probe_kernels.bench import render, run_bench
from probe_kernels.tune import tune

if __name__ == "__main__":
    tune("gpt2-small", 40, apply=True)
    from probe_kernels.parity import run_parity

    fails = run_parity("cuda", 64)
    print("parity with tuned options:", "OK" if not fails else fails, flush=True)
    res = run_bench(["gpt2-small", "gpt2-large"])
    render(res)
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=2)
