"""`TrainHooks`: what a caller plugs into trainer.train.train, one typed object instead of four keywords.

A fleet (`train --coordinator`, `up`, fleet.attach.Fleet) or a test replaces the run's step strategy, its evaluation or
its distillation targets through these; every hook None is the in-process run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from trainer.config import TrainConfig
    from trainer.evaluation import Evaluator
    from trainer.modes import TrainMode
    from trainer.tasks import Task


@dataclass(frozen=True)
class TrainHooks:
    """The hooks of one run (each None: the trainer's own).

    mode_factory(cfg, model) (with a --teacher also `loss_fn=`, the distillation loss): replaces
        trainer.mode_builders.build_mode, e.g. a ZO-Curv or pure-ZO mode whose probes go to a fleet (it must use the
        task's loss).
    status() -> str: a live line (workers, probes/s) added to the progress display.
    evaluator_factory(task, cfg, model, mode): replaces the trainer's own evaluation
        (trainer.evaluation.InlineEvaluator), e.g. fleet.evaluation.FleetEvaluator: its records may arrive steps
        later (logged then, at their own step; one process only: a torchrun job evaluates on its ranks).
    kd_loss_factory(cfg, task, rank, batch_fn=) (batch_fn(step) -> this rank's (x, y)): with --teacher, a loss_fn
        whose targets come from elsewhere (e.g. trainer.kd.sparse_loss.SparseKDLoss: teacher rounds on workers)
        instead of the in-process teacher (trainer.kd.teacher.KDLoss). A loss_fn with a `close()` is closed
        once when the run ends, finished, failed or interrupted (teacher rounds: the teacher run ended).
    """

    mode_factory: Callable[[TrainConfig, torch.nn.Module], TrainMode] | None = None
    status: Callable[[], str] | None = None
    evaluator_factory: Callable[[Task, TrainConfig, torch.nn.Module, TrainMode], Evaluator] | None = None
    kd_loss_factory: Callable[..., Any] | None = None
