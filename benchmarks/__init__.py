"""Benchmarks and experiment drivers (`sparecycles bench ...`): they sit above trainer, probe_worker, api and
coordinator and may use all of them; nothing below imports this package. Kernel benchmarks stay in
probe_kernels/bench.py beside the kernels they measure. Measured results: benchmarks/results/."""
