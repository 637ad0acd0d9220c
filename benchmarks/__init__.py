"""The benchmarks a user runs (`sparecycles bench ...`): they sit above trainer, probe_worker, api and coordinator and
may use all of them; nothing below imports this package. Kernel benchmarks stay in probe_kernels/bench*.py beside the
kernels they measure. The experiments (experiments/, not installed) are not here."""

# The committed figures of these benches: a folder at the repository root, outside every installed package, relative
# to the checkout (the docs' commands run there). A bench writes under runs/ (git-ignored) unless its --out names a
# place here; docs/RESULTS.md cites the files. The experiments keep theirs in experiments/NAME/results/.
RESULTS = "results"
