"""Knowledge distillation from a teacher's sparse targets: estimators, target sampling, config."""
