"""Your loop: the fleet's services for any PyTorch training loop (docs/api.md, "Your loop").

    import sparecycles as sc
    fleet = sc.connect("http://127.0.0.1:8000")           # SPARECYCLES_ADMIN_TOKEN / _REDIS_URL from the env
    windows = sc.lm_windows(val_tokens, batch_size=4, seq_len=64, max_batches=8)
    evals = sc.Evaluation(model, windows, fleet=fleet)      # fleet=None: evaluated here, at once
    anytime = sc.AnytimeModel(model, select_tokens, batch_size=4, seq_len=64, run_dir="run", evaluation=evals)
    opt = sc.ZOCurv(model, lr=3e-4, fleet=fleet)            # a torch.optim.Optimizer
    for step, (x, y) in enumerate(batches):
        loss = sc.lm_loss(model, x, y); loss.backward()
        opt.probe_batch((x, y)); opt.step(); opt.zero_grad()
        anytime.after_step(step + 1)
        if (step + 1) % 50 == 0:
            records = evals.request(step + 1)               # returns at once; records of earlier steps
    records += evals.finish(); anytime.choose(step + 1); anytime.export("run/anytime")

Each piece is the one the CLI trainer runs (`sparecycles train --coordinator`, `up`): `connect` is
fleet.attach.attach (with credentials given here or read from the environment), `Evaluation` wraps
fleet.evaluation.FleetEvaluator (the trainer's `--eval-on fleet`), `AnytimeModel` wraps
trainer.anytime.serve.Anytime (its candidates scored on the fleet by fleet.anytime.FleetScorer through the
evaluation), `ZOCurv` is trainer.zo.wrapper.ZOCurvWrapper over the method registry's optimizers, and
`VersionChannel` publishes weight versions with fleet.backend.CoordinatorBackend. A Hugging Face `Trainer` gets
all of it from sparecycles.hf.FleetCallback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypedDict, Unpack

import torch

from fleet.attach import Fleet, FleetError, FleetSettings, attach, load_settings
from trainer.anytime.serve import Anytime
from trainer.anytime.settings import AnytimeSettings
from trainer.config import TrainConfig
from trainer.evaluation import EvalWindows, InlineWindowsEvaluator, evaluate_all, lm_windows
from trainer.models.losses import lm_loss
from trainer.zo.wrapper import zocurv_wrapper
from wire.messages import RunSpec, share_fields

__all__ = ["AnytimeModel", "Evaluation", "EvalWindows", "Fleet", "FleetError", "VersionChannel", "ZOCurv", "connect",
           "lm_loss", "lm_windows"]


class Credentials(TypedDict, total=False):
    """The keyword credentials of `connect` (each optional; fleet.attach.FleetSettings validates them)."""

    admin_token: str | None
    redis_url: str | None
    key_prefix: str | None
    blob_dir: str | Path | None


def connect(url: str, *, wait_s: float = 120.0, min_workers: int = 1, log=lambda m: None, rounds: str = "async",
            check=lambda: None, settings: FleetSettings | None = None, share: float = 1.0,
            **credentials: Unpack[Credentials]) -> Fleet:
    """Connect to the coordinator at `url` (http(s)) and wait up to `wait_s` s for `min_workers` active workers.

    Credentials (keywords): `admin_token` (the coordinator's admin token), `redis_url` (its Redis, whose result
    streams are read here), `key_prefix` and `blob_dir` (its SPARECYCLES_BLOB_DIR, when this process shares its
    disk); each one not given is read from the environment (SPARECYCLES_ADMIN_TOKEN, ...; fleet.attach.FleetSettings),
    or all of them from `settings` (what `sparecycles train --coordinator` passes, read with its option checks).
    `rounds`: when ZO-Curv rounds fold ("async", "sync": bit-identical to in process, "next";
    fleet.attach.ROUND_MODES). `share`: this process's share of the pool, stated by each of its coordinator runs
    (finite, > 0, at most wire.bounds.MAX_SHARE; default 1): runs with work split the workers' time in proportion to
    their shares (docs/operations.md, "Shares"). `log(line)` hears why it waits. Raises FleetError (unreachable, token refused, no
    worker in time, a credential missing or refused), ValueError (a URL that is not http(s), an unknown `rounds`)
    and TypeError (a keyword that is no credential).
    """
    unknown = set(credentials) - set(Credentials.__annotations__)
    if unknown:
        raise TypeError(f"connect() got unexpected keyword argument(s) {', '.join(sorted(unknown))}")
    given = {k: v for k, v in credentials.items() if v is not None}
    if given and settings is not None:
        raise ValueError("connect takes `settings` or single credentials, not both")
    if given:
        from pydantic import ValidationError

        try:
            base = load_settings().model_dump() if not {"admin_token", "redis_url"} <= set(given) else {}
        except FleetError:
            base = {}
        try:
            settings = FleetSettings(**{**base, **given})
        except ValidationError as exc:
            e = exc.errors(include_input=False, include_url=False)[0]
            raise FleetError(f"connect: {e['loc'][0]} {e['msg'].removeprefix('Value error, ')}") from None
    return attach(url, settings=settings, wait_s=wait_s, min_workers=min_workers, log=log, rounds=rounds,
                  run_prefix="loop", check=check, share=share)


class Evaluation:
    """Held-out evaluation of `model` on fixed `windows` (trainer.evaluation.EvalWindows, e.g. `lm_windows`),
    on the fleet (`fleet`: from `connect`; fleet.evaluation.FleetEvaluator) or here (`fleet=None`).

    `request(step)` hands the current weights over and returns at once with the records ready (on the fleet:
    earlier steps'; here: this one's), `poll()` the records ready now, `finish()` all outstanding ones (a version
    no worker answers for within `deadline_s` s is evaluated here, and its record says `eval_on: "trainer"`).
    A record: {"step", "val_loss" (nats/token: the mean of the batches' mean token cross-entropy), "eval_on", ...};
    on the fleet it equals the in-process one bit for bit on the same device (tests/fleet/test_fleet_eval.py).
    Raises ValueError when the windows' kind is not the model's (CoordinatorHTTPError: the coordinator refused).
    """

    def __init__(self, model: torch.nn.Module, windows: EvalWindows, *, fleet: Fleet | None = None,
                 device: str = "cpu", deadline_s: float = 120.0) -> None:
        from fleet.evaluation import FleetEvaluator

        self.model, self.windows, self.fleet = model, windows, fleet
        self.evaluator = (FleetEvaluator.on_windows(windows, model, fleet, device=device, deadline_s=deadline_s)
                          if fleet is not None else InlineWindowsEvaluator(windows, device))
        self.records: list[dict[str, Any]] = []

    def request(self, step: int) -> list[dict[str, Any]]:
        """Evaluate the weights after `step` optimizer steps; returns the records ready (kept in `records`)."""
        return self._keep(self.evaluator.request(step, self.model))

    def poll(self) -> list[dict[str, Any]]:
        """The records completed since the last call."""
        return self._keep(self.evaluator.poll())

    def finish(self) -> list[dict[str, Any]]:
        """Every outstanding record (waits for the fleet, up to `deadline_s` without progress per version)."""
        return self._keep(self.evaluator.finish())

    def close(self) -> None:
        """Close the fleet connections (nothing to do in process)."""
        close = getattr(self.evaluator, "close", None)
        if callable(close):
            close(wait=True)

    def _keep(self, got: list[dict[str, Any]]) -> list[dict[str, Any]]:
        self.records += got
        return got


class AnytimeModel:
    """The anytime model of a loop (trainer.anytime.serve.Anytime): keep the last k versions, choose a candidate
    (EMAs, averages, a quadratic fit's minimiser) on the selection windows at each `choose`, serve it.

    Args:
        model: the trained module. select_tokens: a selection split, (N,) int token ids (never the reported
            split): windows of `batch_size` x `seq_len`, `settings.select_batches` of them.
        run_dir: folder for served.safetensors. settings: trainer.anytime.settings.AnytimeSettings (or a dict).
        evaluation: an `Evaluation`; on a fleet the candidates are scored there (fleet.anytime.FleetScorer)
            and its windows give the served model's `served_val_loss`.
    Raises ValueError for a ring larger than a fleet eval round's mixture; pydantic.ValidationError for settings.
    """

    def __init__(self, model: torch.nn.Module, select_tokens, *, batch_size: int, seq_len: int,
                 run_dir: str | Path, settings: Any = None, evaluation: Evaluation | None = None,
                 device: str = "cpu") -> None:
        if not isinstance(settings, AnytimeSettings):
            settings = AnytimeSettings(**(settings or {}))
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.model, self.evaluation = model, evaluation
        self.anytime = Anytime(settings, select_tokens, batch_size=batch_size, seq_len=seq_len, device=device,
                               run_path=Path(run_dir), loss=lm_loss)
        ev = evaluation.evaluator if evaluation is not None else None
        if ev is not None and hasattr(ev, "anytime_scorer"):
            self.anytime.score_with(ev.anytime_scorer(self.anytime))
        self.last: dict[str, Any] | None = None

    def after_step(self, step: int) -> None:
        """Keep the weights after `step` optimizer steps as a version (every `settings.publish_every` steps)."""
        self.anytime.publish(step, self.model)

    def choose(self, step: int) -> dict[str, Any]:
        """Choose and serve a candidate at `step`; returns the record (served, served_val_loss, served_sel_loss,
        raw_sel_loss, ...; trainer.anytime.serve.Anytime.evaluate). served_val_loss is measured here on the
        evaluation's windows (NaN without an evaluation)."""
        windows = self.evaluation.windows if self.evaluation is not None else None
        dev = self.anytime.batches[0][0].device if self.anytime.batches else "cpu"
        self.last = self.anytime.evaluate(step, self.model, lambda m: evaluate_all(m, windows, dev) if windows
                                          else {"val_loss": float("nan")})
        return self.last

    def export(self, out: str | Path) -> Path:
        """Write the served model as a transformers folder (`save_pretrained`: config.json + safetensors), which
        AutoModelForCausalLM.from_pretrained loads. Raises RuntimeError before the first `choose`."""
        if self.anytime.scratch is None or self.last is None:
            raise RuntimeError("no served model yet: call choose(step) first")
        out = Path(out)
        self.anytime.scratch.save_pretrained(out)
        return out


class VersionChannel:
    """Publish weight versions of `model` on a coordinator run of its own (fleet.backend.CoordinatorBackend): what
    workers probe or evaluate. `publish(version)` copies the weights to host buffers and uploads them in the
    background; `close()` waits for the uploads (raising the first failure). Versions must increase.
    Raises ValueError for a model whose parameters mix dtypes; CoordinatorHTTPError when the run is refused."""

    def __init__(self, model: torch.nn.Module, fleet: Fleet, *, run: str | None = None) -> None:
        import secrets

        from fleet.backend import BackendTuning, CoordinatorBackend, FleetAddress

        spec = RunSpec(run=run or f"{fleet.run_prefix}-v-{secrets.token_hex(4)}", model_class=type(model).__name__,
                       **share_fields(fleet.share),
                       **({"spot_check_fraction": 0.0} if fleet.workers < 2 else {}))
        s = fleet.settings
        self.backend = CoordinatorBackend.connect(model, spec, FleetAddress.of(fleet.base, s),
                                                  BackendTuning.publishing(s.blob_dir))
        self.run = spec.run

    def publish(self, version: int) -> None:
        """The model's current weights as `version` (> the last one). Raises ValueError otherwise."""
        self.backend.publish(version)

    def manifest(self, version: int) -> Any:
        """The coordinator's wire.messages.VersionManifest of `version` (after `flush`)."""
        return self.backend.client.version(self.run, version)

    def flush(self) -> None:
        """Wait for every upload; raises the first failure."""
        self.backend.flush()

    def close(self) -> None:
        self.backend.close(wait=True)


def ZOCurv(model: torch.nn.Module, *, method: str = "zocurv-block", fleet: Fleet | None = None,
           loss_fn=None, **settings: Any):
    """A ZO-Curv optimizer for `model` (a torch.optim.Optimizer: trainer.zo.wrapper.ZOCurvWrapper): AdamW whose
    per-block step sizes are shaped by curvature multipliers from zeroth-order probe rounds, every
    `curvature_interval` steps, on the batch given to `probe_batch` — on `fleet`'s workers or (None) in process.

    `method`: a zo-curv method of trainer.methods (zocurv-block, zocurv-sophia, ...); `settings`: TrainConfig fields
    (lr, weight_decay, probes, eps, curvature_interval, probe_batch_size, staleness, seed, optimizer_options, ...),
    validated there. `loss_fn(model, batch)`: the probes' loss (default: causal LM on (x, y)). state_dict()
    round-trips through load_state_dict (the AdamW moments and the curvature state).
    Raises pydantic.ValidationError for bad settings; ValueError for a method that is not zo-curv.
    """
    backend = fleet.probe_backend(TrainConfig(optimizer=method, **settings), model) if fleet is not None else None
    return zocurv_wrapper(model, method=method, backend=backend, loss_fn=loss_fn,
                          timing=fleet.rounds if fleet is not None else "async", **settings)
