"""Zeroth-order training: estimators (pure math), curvature state, ZO-Curv optimizers, probe backends,
pure-ZO steps (MeZO, 1SPSA, 1.5-SPSA) and the training-loop modes. See DESIGN.md section 2."""
