"""A run folder and the files the training loop writes into it.

    <run_dir>/config.json            the run's identity (TrainConfig.run_json and where its probes come from,
                                     trainer.preflight.probe_source); --resume must match it. Beside it `steps`,
                                     the total the lr schedule is built for: a --resume may change it (rewritten,
                                     and the resume says how the lr changes: trainer.config.replan_note)
    <run_dir>/metrics.jsonl          one JSON record per step ({"step", "lr", "loss", ...}) and per evaluation
                                     ({"step", "val_loss", ...}); steps count completed optimizer steps
    <run_dir>/checkpoint.safetensors trainer.checkpoint.Checkpointer
    <run_dir>/loss.png, summary.json written when the run finishes
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from trainer.config import TrainConfig, recorded_run
from trainer.paths import runs_dir
from trainer.preflight import differences, run_settings
from trainer.report import read_metrics

CHECKPOINT_NAME = "checkpoint.safetensors"


def not_a_run_folder(path: Path) -> str | None:
    """Why `path` is not the folder of one run (None when it holds a config.json), fit for a user: a missing
    folder, or a folder of runs (`sparecycles up` writes one per run, e.g. adamw/ and zocurv-line/) naming them."""
    path = Path(path)
    if not path.is_dir():
        return f"no run folder at {path}"
    if (path / "config.json").is_file():
        return None
    runs = sorted(p.name for p in path.iterdir() if (p / "config.json").is_file())
    if runs:
        return (f"{path} holds {len(runs)} run{'s' * (len(runs) > 1)} ({', '.join(runs)}; a `sparecycles up` folder): "
                f"export {'one of them' if len(runs) > 1 else 'it'}, "
                f"e.g. `sparecycles export {path / runs[-1]} OUT_DIR`")
    return f"{path} is not a run folder (no config.json); pass the folder `sparecycles train` wrote"


def default_run_dir(cfg: TrainConfig) -> Path:
    """`runs/<model>-<corpus>-<optimizer>-s<seed>` under `trainer.paths.runs_dir()` (sentiment task:
    `runs/minilm-l6-sentiment-<optimizer>-s<seed>`; with `--data PATH`, PATH's file or folder name stands for
    the corpus)."""
    from trainer.models.causal_lm import model_label

    model, data = ("minilm-l6", "sentiment") if cfg.task == "sentiment" else (model_label(cfg.model), cfg.corpus)
    if cfg.data is not None and cfg.task != "sentiment":  # the user's text: the name of its file/folder
        data = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(cfg.data.rstrip("/")).stem).strip("-.") or "data"
    return runs_dir() / f"{model}-{data}-{cfg.optimizer}-s{cfg.seed}"


class RunDir:
    """The folder of one run: where each file lives, the config check on open, and the metrics log.

    Build with `RunDir.open`; `path` is the folder. `planned_steps`: after a resuming `open`, the `steps` the
    folder's config.json records (the total the checkpointed run's lr schedule was built for; `record_steps`
    replaces it once the resume has started); None for a fresh run or a folder from before steps were recorded.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.config = path / "config.json"
        self.metrics = path / "metrics.jsonl"
        self.checkpoint = path / CHECKPOINT_NAME
        self.plot = path / "loss.png"
        self.summary = path / "summary.json"
        self.planned_steps: int | None = None

    @classmethod
    def open(cls, cfg: TrainConfig, *, resume: bool, overwrite: bool, fleet_wait: str | None = None) -> RunDir:
        """Create (or reopen) the folder of `cfg` (cfg.run_dir, else `default_run_dir`) and write config.json: the
        config, where its probes come from (trainer.preflight.probe_source; `fleet_wait` None: in process) and
        `steps` (trainer.preflight.run_settings). A resume compares all but `steps` and keeps the recorded one
        (`planned_steps`) until the trainer has restored the checkpoint and calls `record_steps`: a resume that
        fails before leaves the plan its checkpoint was trained under.

        Raises:
            ValueError: the path is a file, `resume` where no run was started (no config.json; nothing is written),
                or `resume` with a config.json of a different run (names the fields).
            FileExistsError: the folder already holds a run and neither `resume` nor `overwrite` is set.
        """
        run = cls(Path(cfg.run_dir) if cfg.run_dir else default_run_dir(cfg))
        if run.path.exists() and not run.path.is_dir():
            raise ValueError(f"run folder {run.path} exists and is not a folder; pass another --run-dir")
        if resume and not run.config.is_file():  # before writing anything: a mistyped folder stays as it was
            raise ValueError(f"nothing to resume in {run.path} (no config.json: no run was started there); start "
                             "without --resume or pass the right --run-dir")
        run.path.mkdir(parents=True, exist_ok=True)
        ours = run_settings(cfg, fleet_wait)
        if not resume and not overwrite and run.metrics.is_file() and run.metrics.stat().st_size > 0:
            raise FileExistsError(f"{run.path} already holds a run; pass --resume to continue it, --overwrite to "
                                  "start afresh, or another --run-dir")
        if resume and run.config.is_file():
            old = recorded_run(json.loads(run.config.read_text()))
            run.planned_steps = old.pop("steps", None)  # may differ: the run is extended (or shortened)
            ours.pop("steps")
            if old != ours:  # each field with its recorded value and this invocation's
                raise ValueError(f"--resume with a different config than {run.config} (recorded -> given: "
                                 f"{'; '.join(differences(old, ours))})")
            if run.planned_steps is not None:
                ours["steps"] = run.planned_steps
        run.config.write_text(json.dumps(ours, indent=2))
        return run

    def record_steps(self, steps: int) -> None:
        """Record in config.json that the run's lr schedule is built for `steps` from now on (a resume with
        another --steps, once its checkpoint is restored)."""
        recorded = json.loads(self.config.read_text())
        if recorded.get("steps") != steps:
            self.config.write_text(json.dumps({**recorded, "steps": steps}, indent=2))

    @classmethod
    def open_on_ranks(cls, cfg: TrainConfig, *, resume: bool, overwrite: bool, dist: Any,
                      fleet_probes: bool = False) -> RunDir:
        """`open` on rank 0 of `dist` (trainer.distributed.DistContext); the other ranks of a torchrun job wait for
        it and get the same folder (writing nothing), or raise rank 0's error. `fleet_probes`: a fleet answers the
        run's probes, folding as `dist.fleet_rounds` says (recorded as its --fleet-wait)."""
        from trainer.run_options import FLEET_ROUNDS

        wait = {v: k for k, v in FLEET_ROUNDS.items()}[dist.fleet_rounds] if fleet_probes and dist.fleet else None
        if not dist.parallel:
            return cls.open(cfg, resume=resume, overwrite=overwrite, fleet_wait=wait)
        run, error = None, None
        if dist.is_main:
            try:
                run = cls.open(cfg, resume=resume, overwrite=overwrite, fleet_wait=wait)
            except (ValueError, FileExistsError) as exc:
                error = exc
        got = dist.broadcast_object((str(run.path) if run else None, error))
        if got[1] is not None:
            raise got[1]
        return run or cls(Path(got[0]))

    def restart_metrics(self, at_step: int | None) -> list[dict[str, Any]]:
        """Keep the records logged up to `at_step` (the step of the checkpoint a resume starts from; None: a
        fresh run keeps none) and return them: records after the checkpoint are re-logged by the resumed run."""
        kept = [] if at_step is None else [r for r in read_metrics(self.metrics) if r["step"] <= at_step]
        self.metrics.write_text("".join(json.dumps(r) + "\n" for r in kept))
        return kept

    def log(self, record: dict[str, Any]) -> None:
        """Append one JSON record to metrics.jsonl."""
        with self.metrics.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def records(self) -> list[dict[str, Any]]:
        """Every record of metrics.jsonl, in order."""
        return read_metrics(self.metrics)

    def write_summary(self, summary: dict[str, Any]) -> None:
        """Write summary.json."""
        self.summary.write_text(json.dumps(summary, indent=2))
