"""Knowledge distillation from a teacher's sparse targets (issue 36): estimators, target sampling, config."""
