"""Settings of the anytime model (trainer.anytime): which versions are kept, which candidates are scored."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


class AnytimeSettings(BaseModel):
    """The anytime model of a run (`TrainConfig.anytime`; None = off).

    Every `publish_every` optimizer steps the trainer publishes a version (its weights); the last `k` are
    kept (in the trainer, and on each worker that scores candidates). At every evaluation the candidates
    over those versions (trainer.anytime.candidates: raw, EMAs at `half_lives` versions, uniform averages
    of the last m for m in `windows`, and the minimiser of a quadratic fitted over a {quad_dim, quad_n}
    simplex lattice spanned by raw and the best quad_dim named candidates; quad_dim 0 = no fit) are scored
    on `select_batches` batches of the corpus's *selection* split; the winner is served: its validation
    loss is logged beside the raw one. `pull`: when the served model beats raw on the selection split by
    more than `pull_z` standard errors (paired over batches), the trainer's weights move to it (the
    optimizer state is kept) — an ablation, off by default.

    Raises:
        pydantic.ValidationError: out-of-range values.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    k: int = Field(8, ge=2, le=64, description="versions kept")
    publish_every: int = Field(10, ge=1, description="optimizer steps between published versions")
    half_lives: tuple[Annotated[float, Field(gt=0)], ...] = Field((1.0, 2.0, 4.0), description="EMA half-lives, in versions")
    windows: tuple[Annotated[int, Field(ge=1)], ...] = Field((2, 4, 8), description="uniform averages over the m newest versions")
    select_batches: int = Field(8, ge=1, le=10_000, description="batches of the selection split per candidate")
    quad_dim: int = Field(2, ge=0, le=4, description="anchors besides raw for the quadratic fit (0 = no fit)")
    quad_n: int = Field(3, ge=2, le=6, description="lattice divisions of the design")
    quad_rel_tol: float = Field(0.05, gt=0, le=1.0, description="refuse a fit with residual RMS > tol x std")
    pull: bool = Field(False, description="ablation: move the trainer to the served model when it beats raw by > "
                       "pull_z standard errors on the selection split (optimizer state kept)")
    pull_z: float = Field(3.0, gt=0, description="--anytime-pull: standard errors of the margin")
