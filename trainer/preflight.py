"""Checks that run before anything trains or any service starts.

- `check_options(cfg)`: settings that TrainConfig alone cannot judge (the model's context, the corpus
  name, the device, the task's optimizers), so a bad option fails in a second, not after minutes.
- `probe_rounds(cfg)` / `folded_rounds(cfg, fleet_wait)` / `no_probe_round_warning(cfg, fleet_wait)`: how many
  curvature rounds a ZO-Curv run probes, how many of them can fold before it ends, and the warning when none can.
- `run_settings(cfg, fleet_wait)` / `folder_state(run_dir, cfg, fleet_wait)`: what defines a run (its config and
  where its probes come from, `probe_source`), and whether a run folder is free, holds this run finished or
  interrupted, or holds another run (and how its settings differ), so no finished run is overwritten or reused by
  accident.

Pure functions over configs and small JSON files; nothing here trains or starts a process.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from trainer.cli_settings import explain as explain  # re-exported: the CLIs import it from here
from trainer.config import TrainConfig, recorded_run
from trainer.methods import fleet_method_names, get_method, method_names


def check_environment(environ: dict[str, str] | None = None) -> None:
    """Raise ValueError naming the variable when a folder variable of the environment cannot be used:
    SPARECYCLES_CACHE or SPARECYCLES_RUNS naming a file (or a path under one). Called by `check_options`, before
    any folder is created or port opened."""
    env = os.environ if environ is None else environ
    for name in ("SPARECYCLES_CACHE", "SPARECYCLES_RUNS"):
        value = env.get(name)
        if not value:
            continue
        path = Path(value).expanduser()
        blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            where = "is a file" if blocker == path else f"is under {blocker}, a file"
            raise ValueError(f"{name}={value} {where}, not a folder: point {name} at a folder (or unset it)")


def check_coordinator_url(url: str) -> None:
    """Raise ValueError naming --coordinator and SPARECYCLES_COORDINATOR_URL (either sets it) when `url` is not an
    http(s) URL with a host. Called with the option checks, before the metrics server starts."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname)
        _ = parts.port  # raises ValueError for a port that is no number or out of range
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"--coordinator (or SPARECYCLES_COORDINATOR_URL): {url!r} is not an http(s) URL; "
                         "give the coordinator's address, e.g. http://127.0.0.1:8000")


def check_options(cfg: TrainConfig) -> None:
    """Raise ValueError naming the option when `cfg` cannot run on this machine with this data.

    Checks the corpus name, the model (a preset or a folder: trainer.models.causal_lm.check_model_spec) and its context (`--seq-len` at most `n_positions`; for
    `--task sentiment` at most MiniLM-L6's 512 positions), ZO-Curv on the sentiment task, and CUDA for
    `--device cuda[:N]`, and the environment's folders first (`check_environment`). Imports torch only for a CUDA
    device.
    """
    check_environment()
    if cfg.task not in get_method(cfg.optimizer).tasks:  # TrainConfig refuses it too; kept for configs built by hand
        raise ValueError(f"--task {cfg.task} supports {', '.join(method_names(task=cfg.task))}, not {cfg.optimizer!r}; "
                         "ZO-Curv variants run on the LM task (--task lm)")
    if cfg.task == "sentiment":
        if cfg.seq_len > 512:  # MiniLM-L6's max_position_embeddings
            raise ValueError(f"--seq-len {cfg.seq_len} exceeds MiniLM-L6's 512 positions")
    else:
        from trainer.data.corpus import CORPORA
        from trainer.models.causal_lm import check_model_spec, check_roles

        if cfg.data is not None:
            from trainer.data.user_read import find_inputs, is_packed

            if not is_packed(Path(cfg.data).expanduser()):
                find_inputs(cfg.data)  # DataInputError naming the path: nothing there, no text files
        elif cfg.corpus not in CORPORA:
            raise ValueError(f"--corpus: unknown corpus {cfg.corpus!r}; valid names: {', '.join(sorted(CORPORA))}")
        check_model_spec(cfg.model, cfg.seq_len)  # preset or folder: context, class, tokenizer, vocab
        if get_method(cfg.optimizer).options.__name__ in ("RoleOptions", "RegimeOptions"):
            check_roles(cfg.model)  # the block-role methods: every parameter placed, or the first one named
    if cfg.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"--device {cfg.device}: CUDA is not available on this machine; use --device cpu")
        index = int(cfg.device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ValueError(f"--device {cfg.device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def input_warning(cfg: TrainConfig) -> str | None:
    """The warning for files of `--data`'s folder (or glob) that the run does not read for their type
    (trainer.data.user_read.skipped_warning); None without --data, for a packed corpus, or when every file is read."""
    if cfg.data is None or cfg.task != "lm":
        return None
    from trainer.data.user_read import is_packed, skipped_warning

    return None if is_packed(Path(cfg.data).expanduser()) else skipped_warning(cfg.data)


def probe_rounds(cfg: TrainConfig) -> int | None:
    """Curvature probe rounds a ZO-Curv run of `cfg.steps` steps runs; None for optimizers without rounds
    (AdamW, pure ZO, the zero-probe ablation zocurv-group-fixed).

    A round is due at 0-based steps s with s % curvature_interval == 0 (trainer.zo.modes.ZOCurvMode). zocurv-line (along θ_s − θ_{s−1}) and zocurv-global (along
    θ_s − θ_{s−k}) need an earlier version, so they skip s = 0: (steps − 1) // interval rounds. The others
    also probe at s = 0: one more. zocurv-trust (`Method.probes_after_warmup`) probes only at s >= warmup_steps.
    A "round" here is a refresh's rounds (zocurv-trust sends B·R per refresh).
    """
    first = first_probe_step(cfg)
    if first is None:
        return None
    return 0 if first > cfg.steps - 1 else (cfg.steps - 1 - first) // cfg.curvature_interval + 1


def first_probe_step(cfg: TrainConfig) -> int | None:
    """The 0-based step of a ZO-Curv run's first round (`probe_rounds`), None for optimizers without rounds."""
    method = get_method(cfg.optimizer)
    if method.kind != "zo-curv" or not method.needs_probes:
        return None
    k = cfg.curvature_interval
    first = k if method.probes_along_step else 0
    return max(first, -(-cfg.warmup_steps // k) * k) if method.probes_after_warmup else first


TOO_SHORT = "run too short for its interval:"  # how no_probe_round_warning starts (up and train test for it)


def fold_lag(fleet_wait: str | None) -> int:
    """Curvature intervals between a round's sending and the earliest refresh that can fold it: 0 in process
    (`fleet_wait` None) or with --fleet-wait sync (the trainer waits at the round's own refresh); 1 on a fleet with
    --fleet-wait interval (it folds at the refresh after it, trainer.zo.rounds) or never (at best the refresh after).
    Raises ValueError for another `fleet_wait`."""
    if fleet_wait not in (None, "sync", "interval", "never"):
        raise ValueError(f"--fleet-wait must be never, interval or sync, got {fleet_wait!r}")
    return 0 if fleet_wait in (None, "sync") else 1


def folded_rounds(cfg: TrainConfig, fleet_wait: str | None = None) -> int | None:
    """Curvature rounds of `probe_rounds` that can fold within `cfg.steps` steps: a round sent at step s folds at
    s + fold_lag(fleet_wait)·curvature_interval at the earliest, so only those with that step < steps change the
    run. None for optimizers without rounds."""
    first = first_probe_step(cfg)
    if first is None:
        return None
    first_fold = first + fold_lag(fleet_wait) * cfg.curvature_interval
    return 0 if first_fold > cfg.steps - 1 else (cfg.steps - 1 - first_fold) // cfg.curvature_interval + 1


def no_probe_round_warning(cfg: TrainConfig, fleet_wait: str | None = None) -> str | None:
    """The warning for a ZO-Curv run too short for its curvature interval: no round it sends can fold in its
    `cfg.steps` steps (`folded_rounds`; `fleet_wait` None: in process), so it is then AdamW. None otherwise. The
    message starts with TOO_SHORT and names the cause (the run's length, not the fleet's speed) and the fix."""
    if folded_rounds(cfg, fleet_wait) != 0:
        return None
    k, first = cfg.curvature_interval, first_probe_step(cfg)
    lag = fold_lag(fleet_wait)
    why = "; ".join([*(["it probes along the steps before"] if get_method(cfg.optimizer).probes_along_step else []),
                     *(["from the end of warmup"] if first > k else [])])
    sent = f"its first round is sent at step {first} (--curvature-interval {k}{'; ' + why if why else ''})"
    if lag:
        sent += (f" and, on a fleet with --fleet-wait {fleet_wait}, folds at the refresh after it, step {first + k} "
                 "at the earliest")
    fix = (f"Use --steps {first + lag * k + 1} or more, or a smaller --curvature-interval"
           + (", or --fleet-wait sync" if lag else ""))
    return (f"{TOO_SHORT} {cfg.optimizer} applies no curvature probe round in {cfg.steps} steps: {sent}, so this "
            f"run equals AdamW whatever the fleet's speed. {fix}.")


def probe_source(cfg: TrainConfig, fleet_wait: str | None = None) -> dict[str, Any]:
    """Where a run's probes come from, as its config.json records it beside TrainConfig.run_json: these change the
    run's numbers as much as a setting does (a round folded one interval later shapes other steps).

    `fleet_wait`: the run's --fleet-wait when a fleet answers its probes (train --coordinator, up), None when they
    are computed in this process. {} in process, or for a method whose probes never go to a fleet (AdamW;
    trainer.methods.fleet_method_names), so folders from before this record still match;
    {"probe_source": "fleet"} for a pure-ZO method (each step waits for its round: the wait changes nothing), plus
    "fleet_wait" and "fold_lag" (`fold_lag`) for a method with curvature rounds. Raises ValueError for another
    `fleet_wait`."""
    if fleet_wait is None or cfg.optimizer not in fleet_method_names(cfg.task):
        return {}
    lag = fold_lag(fleet_wait)
    rounds = {"fleet_wait": fleet_wait, "fold_lag": lag} if get_method(cfg.optimizer).kind == "zo-curv" else {}
    return {"probe_source": "fleet", **rounds}


def run_settings(cfg: TrainConfig, fleet_wait: str | None = None) -> dict[str, Any]:
    """Everything that defines a run's result: the config as JSON and where its probes come from (`probe_source`;
    `fleet_wait` None: in process), `steps` included, `run_dir` excluded."""
    return {**cfg.run_json(), **probe_source(cfg, fleet_wait), "steps": cfg.steps}


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """"name: old -> new" for every key whose value differs (a missing key shows as None), sorted by key."""
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


@dataclass(frozen=True)
class FolderState:
    """What a run folder holds relative to a config.

    kind: "empty" (nothing to keep), "done" (this run, finished), "resume" (this run, interrupted, with a
    checkpoint) or "other" (another run, or files of an unknown one). diffs: `differences` for "other".
    """

    kind: Literal["empty", "done", "resume", "other"]
    diffs: tuple[str, ...] = ()


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def folder_state(run_dir: Path, cfg: TrainConfig, fleet_wait: str | None = None) -> FolderState:
    """Classify `run_dir` (a `sparecycles train` folder) against `cfg` with its probes from a fleet waiting as
    `fleet_wait` says (None: in process; `run_settings`); see FolderState.

    The folder's settings are its `config.json`, `steps` included (the total its lr schedule is built for; a
    `--resume` with another --steps rewrites it, trainer.run_dir); a folder from before steps were recorded there
    takes them from a finished run's `summary.json`, or judges the rest when interrupted. A run probed by a
    fleet and the same settings probed in process are other runs (`probe_source`): neither reuses nor resumes the
    other.
    """
    run_dir = Path(run_dir)
    metrics, summary_path = run_dir / "metrics.jsonl", run_dir / "summary.json"
    has_run = (metrics.is_file() and metrics.stat().st_size > 0) or summary_path.is_file()
    if not has_run:
        return FolderState("empty")
    old = _read_json(run_dir / "config.json")
    if old is None:
        return FolderState("other", (f"{run_dir} holds metrics but no readable config.json",))
    old = recorded_run(old)
    new = run_settings(cfg, fleet_wait)
    summary = _read_json(summary_path)
    if summary is not None and "steps" in summary and "steps" not in old:  # a folder from before config.json had
        old = {**old, "steps": summary["steps"]}  # them (else config.json's: an extension stopped midway is newer)
    old.pop("run_dir", None)
    if "steps" not in old:  # interrupted, steps not recorded: judge the rest
        new = {k: v for k, v in new.items() if k != "steps"}
    diffs = differences(old, new)
    if diffs:
        return FolderState("other", tuple(diffs))
    if summary is not None and summary.get("steps") == cfg.steps:
        return FolderState("done")
    # a single process's checkpoint, or a torchrun job's (trainer.dist_checkpoint: its JSON written last)
    if (run_dir / "checkpoint.safetensors").is_file() or any(
            (run_dir / d / "sparecycles.json").is_file() for d in ("checkpoint.dcp", "checkpoint.dcp.old")):
        return FolderState("resume")
    return FolderState("empty")  # same settings, nothing past the first checkpoint: restarting loses nothing
