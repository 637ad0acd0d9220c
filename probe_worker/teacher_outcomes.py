"""Why a teacher round went unanswered, as exceptions its runtime raises and probe_worker.teacher.run_teacher
counts by outcome: shared by the loading teacher (probe_worker.teacher) and the engine teacher
(probe_worker.engine_teacher), which the teacher worker's entry point chooses between."""

from __future__ import annotations


class TeacherRefused(RuntimeError):
    """Neither the task's folder nor the store's published copy gives this worker the task's teacher (or, for an
    engine teacher, the engine is not the round's teacher: probe_worker.engine_teacher). Outcome `refused`."""


class TeacherUnanswered(RuntimeError):
    """A round left unanswered for a reason counted under its own outcome (`outcome`): the engine of an engine
    teacher timed out or answered what is not targets (probe_worker.engine_teacher). Not requeued: the trainer's
    step trains on CE alone and counts it missing."""

    outcome = "error"
