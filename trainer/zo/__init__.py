"""Zeroth-order training: estimators (pure math), curvature state, ZO-Curv optimizers, probe backends,
pure-ZO steps (MeZO, 1SPSA, 1.5-SPSA) and the training-loop modes. See DESIGN.md section 2.

DEFAULT_ZOCURV is the ZO-Curv variant the side-by-side benchmark supports (experiments/zo/results/RESULTS.md):
curvature along the update direction was the only variant ahead of the best AdamW lr we tried.
"""

DEFAULT_ZOCURV = "zocurv-line"
