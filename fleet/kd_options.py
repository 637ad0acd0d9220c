"""How `kd fill` asks its teacher workers (`FillOptions`), as a typed model: pydantic only, so `sparecycles kd fill
--help` builds its options from these fields (sparecycles.kd_cli.KdFillOptions nests it) without importing Redis or
torch. fleet.kd_fill.fill takes it; each bound is declared here once."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class FillOptions(BaseModel):
    """How a fill asks. run: the queue's run name (fleet.teacher.teacher_queue(run); default kd-<teacher
    sha256[:12]>-<seed>, the name `train --teacher-rounds` uses, so the same workers serve both); window: rounds out
    at once; timeout_s: seconds a window waits for answers before re-sending the unanswered; attempts: sends per step
    before giving up; poll_s: seconds between reads of the answers; keys: the run name of this fill's answers' keys
    (default: the queue's run name and this fill's own id, so two fills of one plan at once never take each other's
    answers, as two `train --teacher-rounds` do not). Raises pydantic.ValidationError (a ValueError) when a value is
    outside its bounds."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run: str | None = Field(None, min_length=1, description="The run name of the teacher queue "
                            "(sparecycles.teacher.RUN). Default: kd-<teacher sha256[:12]>-<seed>, as `train "
                            "--teacher-rounds` names it")
    window: int = Field(32, ge=1, le=4096, description="Teacher rounds out at once")
    timeout_s: float = Field(120.0, ge=0.001, allow_inf_nan=False, description="Seconds a window waits for answers "
                             "before sending the unanswered steps again (workers may come and go)")
    attempts: int = Field(5, ge=1, description="Sends per step before the fill stops (what it stored is kept)")
    poll_s: float = Field(0.05, gt=0.0, allow_inf_nan=False, description="Seconds between reads of the answers")
    keys: str | None = Field(None, min_length=1, description="The run name of this fill's answers' keys (default: "
                             "the queue's run name and the fill's own id)")
