"""`sparecycles up`, before anything starts: validate every option and decide what happens to the run folder.

`plan_up` returns an `UpPlan` (both runs' configs, the folder, what each run's sub-folder holds, warnings)
or raises ValueError; it trains nothing and starts no process. `sparecycles.up.run_up` carries a plan out.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

UP_SETTINGS = "up_settings.json"
# Settings that name a non-default `up` folder: runs/up-<preset>-<optimizer>[-steps5][-k4][-b8][-t16][-ci4].
_NAME_TAGS = {"steps": "steps", "probes": "k", "batch_size": "b", "seq_len": "t", "curvature_interval": "ci"}
# What `--overwrite` removes from an `up` folder (besides the runs' own folders); never anything else there.
_UP_FILES = (UP_SETTINGS, "summary.json", "loss_curves.png", "curves.png", "blobs", "valkey")


@dataclass(frozen=True)
class UpPlan:
    """What `up` will do, decided and validated before anything starts (`plan_up`).

    `states` maps "adamw" and `optimizer` to the trainer.preflight.FolderState of their sub-folders of `out`;
    `clear` is set when `--overwrite` replaces another run there; `warnings` go to the console and summary.
    """

    task: str
    preset: str
    optimizer: str
    workers: int
    out: Path
    base_cfg: Any
    zo_cfg: Any
    states: dict[str, Any]
    clear: bool
    warnings: tuple[str, ...]
    worker_devices: tuple[str, ...] = ()  # one torch device per worker process (fleet.devices); () = cpu
    eval_on: str = "fleet"  # where held-out evaluation runs: fleet (fleet.evaluation) or trainer
    eval_windows: str = "subset"  # on the fleet: the runs' eval_batches windows (as on the trainer), or the whole split
    fleet_wait: str = "interval"  # when the ZO run waits for its rounds (trainer.cli.FLEET_WAIT)
    eval_deadline: float = 120.0  # seconds without a result before the trainer evaluates a version itself
    nproc: int | None = None  # the trainer's ranks under torchrun (`--nproc-per-node`); None: in `up`'s process

    @property
    def teacher_rounds(self) -> bool:
        """Whether the runs' `--teacher` answers on the fleet (teacher worker processes, fleet.teacher): a sparse
        estimator (sampled, topk), in `up`'s process or under torchrun (each rank sends its own rows' rounds).
        Otherwise (--kd-estimator full) the teacher runs in the trainer."""
        cfg = self.zo_cfg
        return cfg.teacher is not None and cfg.kd_estimator != "full"

    @property
    def settings(self) -> dict[str, dict]:
        """Both runs' settings (trainer.preflight.run_settings, plus where they are evaluated and the ZO run's wait
        policy), as written to `up_settings.json`."""
        from trainer.preflight import run_settings

        evaluation = {"eval_on": self.eval_on, "eval_windows": self.eval_windows if self.eval_on == "fleet" else None}
        return {"adamw": {**run_settings(self.base_cfg), **evaluation},
                self.optimizer: {**run_settings(self.zo_cfg), **evaluation, "fleet_wait": self.fleet_wait}}


def read_json(path: Path) -> dict | None:
    """The JSON object in `path`, or None if it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _folder_diffs(out: Path, settings: dict[str, dict], states: dict) -> list[str]:
    """How the runs recorded in `out` differ from `settings` ("field: old -> new"); [] when they match or
    `out` holds none. Reads `up_settings.json` (written by `up` before training) and each run's own files."""
    from trainer.config import recorded_run
    from trainer.preflight import differences

    diffs: set[str] = set()
    recorded = read_json(out / UP_SETTINGS)
    old_summary = read_json(out / "summary.json") or {}
    old_opt = ([k for k in recorded if k != "adamw"] or [None])[0] if recorded else old_summary.get("optimizer")
    new_opt = next(k for k in settings if k != "adamw")
    if old_opt is not None and old_opt != new_opt:
        diffs.add(f"optimizer: {old_opt!r} -> {new_opt!r}")
    elif recorded:
        for name, new in settings.items():
            diffs.update(differences(recorded_run(recorded.get(name, {})), new))
    for st in states.values():
        diffs.update(st.diffs)
    return sorted(diffs)


def plan_up(*, preset: str = "demo", optimizer: str | None = None, workers: int = 2, steps: int | None = None,
            run_dir: Path | None = None, curvature_interval: int | None = None, task: str = "lm",
            probes: int | None = None, batch_size: int | None = None, seq_len: int | None = None,
            overwrite: bool = False, device: str | None = None, worker_devices: tuple[str, ...] = (),
            train_options: tuple[str, ...] = (), eval_on: str = "auto", eval_windows: str = "subset",
            fleet_wait: str = "interval", eval_deadline: float = 120.0, nproc_per_node: int | None = None,
            optimizer_options: dict | None = None, settings: dict | None = None) -> UpPlan:
    """Validate every option of `up` and decide what happens to its run folder; starts and trains nothing.

    `device` is the trainer's torch device (both runs), `worker_devices` one device per worker process
    (fleet.devices.place decides both). The folder is `run_dir`, else `runs/up-<preset>-<optimizer>` plus a tag per setting that differs from
    the preset's (`-steps5`, `-k4`, `-b8`, `-t16`, `-ci4`; another `--model`: its name, then `--data`'s file or
    folder name, first, e.g. up-demo-zocurv-line-my-llama-my_texts), so runs with other settings get other folders.
    `train_options` ("KEY=VALUE", `up --set`) set any other TrainConfig field of both runs (e.g. lr=6e-4,
    warmup_steps=40, min_lr=6e-5, corpus=classics, eval_every=25), validated by TrainConfig. `eval_on`
    (trainer|fleet|auto; auto = fleet: `up` always has one) and `eval_windows` (full|subset) place both runs'
    evaluation; `fleet_wait` (never|interval|sync) is the ZO run's wait policy (interval: `up`'s exact-resume mode).
    `nproc_per_node`: train each run under torchrun with that many ranks (sparecycles.up_ranks; None: in this
    process); with more than one, a CUDA trainer takes cuda:0..N-1 (device "cuda") and evaluation runs on the
    ranks (`eval_on` auto means trainer there). `optimizer_options`: the fleet-probed run's optimizer knobs
    (`up --optimizer-option`, validated by TrainConfig against the method); each adds -KEY-VALUE to the folder name.
    `settings`: more TrainConfig overrides of both runs (`up`'s generated options, trainer.cli_settings), besides
    `train_options`; a setting in both is refused.
    Raises ValueError (message names the option) for an invalid option (more ranks than CUDA devices, a batch
    the ranks cannot split, --eval-on fleet with N > 1 included), or when the folder holds a run with other
    settings and `overwrite` is not set (the message lists the differences).
    """
    from trainer.config import resolve_preset
    from trainer.launch import check_ranks
    from trainer.paths import runs_dir
    from trainer.preflight import (
        FolderState,
        check_options,
        explain,
        folder_state,
        no_probe_round_warning,
    )

    _check_choices(task=task, eval_on=eval_on, eval_windows=eval_windows, fleet_wait=fleet_wait, workers=workers)
    sentiment = task == "sentiment"
    optimizer = optimizer or ("1.5spsa" if sentiment else "zocurv-line")
    _check_fleet_optimizer(optimizer, task)
    preset = "sentiment-demo" if sentiment and preset == "demo" else preset
    if nproc_per_node is not None:
        device, eval_on = _rank_placement(nproc_per_node, device, eval_on)
    given = {k: v for k, v in dict(steps=steps, curvature_interval=curvature_interval, probes=probes,
                                   batch_size=batch_size, seq_len=seq_len).items() if v is not None}
    both = set(given) & set(settings or {})
    if both:
        raise ValueError(f"{', '.join(sorted(both))} given twice")
    over = {"task": task, "device": device,
            **parse_train_options(train_options, {**given, **(settings or {})})}
    try:
        _plan_checked(preset, over, optimizer, optimizer_options, sentiment, set(over) - set(given) - set(settings or {})
                      - {"task", "device"})
    except ValueError as exc:
        raise ValueError(str(exc)) from None
    try:
        if not sentiment and "staleness" not in over:
            # A fleet answers a round while the trainer moves on; versions advance with steps, so the staleness
            # bound must cover the rounds' round trip: two curvature intervals. The one place this default is
            # set; TrainConfig.staleness's description (train/up --help) and README "Defaults" say it.
            over["staleness"] = 2 * resolve_preset(preset, over).curvature_interval
        zo_cfg = resolve_preset(preset, {**over, "optimizer": optimizer,
                                         **({"optimizer_options": optimizer_options} if optimizer_options else {})})
        base_cfg = resolve_preset(preset, {**over, "optimizer": "adamw"})
        default = resolve_preset(preset, {"task": task, "optimizer": optimizer})
    except ValueError as exc:  # pydantic's ValidationError is one; so is an unknown preset
        raise ValueError(explain(exc)) from None
    check_options(zo_cfg)  # _plan_checked ran these with --set names: here they pass
    check_options(base_cfg)
    if zo_cfg.teacher is not None:  # before any process starts: the method, the teacher folder and its tokenizer
        from trainer.kd.teacher import check_teacher_run

        check_teacher_run(zo_cfg, fleet=True)
    if nproc_per_node is not None:
        check_ranks(nproc_per_node, (base_cfg, zo_cfg))
    tags = [f"{tag}{getattr(zo_cfg, f)}" for f, tag in _NAME_TAGS.items() if getattr(zo_cfg, f) != getattr(default, f)]
    tags += [f"{k}-{v}" for k, v in sorted((optimizer_options or {}).items())]
    if zo_cfg.data is not None:  # --data PATH: named by its file or folder name, as `train`'s run folders are
        tags.insert(0, re.sub(r"[^A-Za-z0-9._-]+", "-", Path(zo_cfg.data.rstrip("/")).stem).strip("-.") or "data")
    if zo_cfg.model != default.model:  # --model DIR: named by the folder's name
        from trainer.models.causal_lm import model_label

        tags.insert(0, model_label(zo_cfg.model))
    out = (Path(run_dir) if run_dir else runs_dir() / "-".join(["up", preset, optimizer, *tags])).resolve()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--run-dir {out} exists and is not a folder")
    base_cfg = base_cfg.model_copy(update={"run_dir": out / "adamw"})
    zo_cfg = zo_cfg.model_copy(update={"run_dir": out / optimizer})
    states = {"adamw": folder_state(out / "adamw", base_cfg), optimizer: folder_state(out / optimizer, zo_cfg)}
    plan = UpPlan(task, preset, optimizer, workers, out, base_cfg, zo_cfg, states, False,
                  tuple(w for w in [no_probe_round_warning(zo_cfg, fleet_wait)] if w), tuple(worker_devices),
                  eval_on="trainer" if eval_on == "trainer" else "fleet", eval_windows=eval_windows,
                  fleet_wait=fleet_wait, eval_deadline=eval_deadline, nproc=nproc_per_node)
    if not overwrite:  # a corrupt checkpoint fails here, in one line, before any fleet process starts
        from trainer.checkpoint import checkpoint_problem

        for name, state in states.items():
            if state.kind == "resume" and (problem := checkpoint_problem(out / name / "checkpoint.safetensors")):
                raise ValueError(problem)
    diffs = _folder_diffs(out, plan.settings, states)
    if diffs and not overwrite:
        raise ValueError(f"{out} holds a run with other settings ({'; '.join(diffs)}); nothing was changed. "
                         "Pass --overwrite to replace it, or another --run-dir (without --run-dir, the default "
                         "folder name carries --steps, --probes, --batch-size, --seq-len, --curvature-interval)")
    if overwrite:
        plan = replace(plan, clear=True, states={k: FolderState("empty") for k in states})
    return plan


def _set_names(message: str, from_set: set[str]) -> str:
    """`message` (option errors: "--seq-len: ...", "--corpus: ...") with each setting that came from `up --set`
    named as the user wrote it: "--set seq_len" (issue 39: an error must name what the user typed)."""
    import re

    for key in sorted(from_set, key=len, reverse=True):
        message = re.sub(rf"--{re.escape(key.replace('_', '-'))}(?![\w-])", f"--set {key}", message)
    return message


def _plan_checked(preset: str, over: dict[str, Any], optimizer: str, optimizer_options: dict | None,
                  sentiment: bool, from_set: set[str]) -> None:
    """Build and check both runs' configs as `plan_up` does; raises ValueError whose message names the settings
    given through `--set` as `--set KEY` (`_set_names`)."""
    from trainer.config import resolve_preset
    from trainer.preflight import check_options, explain

    try:
        zo = resolve_preset(preset, {**over, "optimizer": optimizer,
                                     **({"optimizer_options": optimizer_options} if optimizer_options else {})})
        base = resolve_preset(preset, {**over, "optimizer": "adamw"})
        check_options(zo)
        check_options(base)
    except ValueError as exc:
        raise ValueError(_set_names(explain(exc), from_set)) from None


def _rank_placement(nproc: int, device: str | None, eval_on: str) -> tuple[str | None, str]:
    """(device, eval_on) of a trainer of `nproc` ranks under torchrun: more than one CUDA rank takes device "cuda"
    (rank r on cuda:r) and evaluation runs on the ranks (a sharded forward is collective). Raises ValueError for
    more ranks than CUDA devices, CUDA where none is visible (trainer.launch.launch_backend), or --eval-on fleet with
    more than one rank."""
    from trainer.launch import launch_backend

    launch_backend(nproc, device)
    if nproc == 1:
        return device, eval_on
    if eval_on == "fleet":
        raise ValueError(f"--eval-on fleet: a trainer of {nproc} ranks evaluates on its ranks (their forward is "
                         "collective); drop --eval-on fleet or --nproc-per-node")
    return ("cuda" if device and device.startswith("cuda") else device), "trainer"


def _check_choices(*, task: str, eval_on: str, eval_windows: str, fleet_wait: str, workers: int) -> None:
    """Raise ValueError (naming the option) for a --task, --eval-on, --eval-windows or --fleet-wait outside its
    choices, or --workers outside 1 to 64."""
    if task not in ("lm", "sentiment"):
        raise ValueError(f"--task must be lm or sentiment, got {task!r}")
    for name, value, choices in (("--eval-on", eval_on, ("trainer", "fleet", "auto")),
                                 ("--eval-windows", eval_windows, ("full", "subset")),
                                 ("--fleet-wait", fleet_wait, ("never", "interval", "sync"))):
        if value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    if not 1 <= workers <= 64:
        raise ValueError(f"--workers must be 1 to 64, got {workers}")


def _check_fleet_optimizer(optimizer: str, task: str) -> None:
    """Raise ValueError, saying why, when `optimizer` is not a fleet-probed optimizer of `task`
    (trainer.methods.fleet_method_names)."""
    from trainer.methods import METHODS, fleet_method_names

    allowed = fleet_method_names(task)
    if optimizer not in allowed:
        why = {"adamw": "AdamW is the baseline `up` always runs; "}.get(optimizer, "")
        method = METHODS.get(optimizer)
        if method is not None and method.kind != "first-order" and not method.needs_probes:
            why = "it sends no probes (train it in process with `sparecycles train`); "
        elif method is not None and not method.fleet:
            why = f"its probes run in process only (`sparecycles train`), not on a fleet: {method.no_fleet_why}; "
        raise ValueError(f"--optimizer {optimizer!r}: {why}the fleet-probed optimizer for --task {task} is one of "
                         f"{', '.join(allowed)}")


# `up --set` may not set what `up` decides itself (the runs' optimizers, folders, devices and task): `up` has
# options of its own for them.
NOT_SETTABLE = ("optimizer", "optimizer_options", "run_dir", "device", "task")


def parse_train_options(items: tuple[str, ...] | list[str], settings: dict | None = None) -> dict[str, Any]:
    """TrainConfig overrides of both runs from "KEY=VALUE" strings (`up --set`, trainer.cli_settings.parse_set:
    the names of `train`'s generated options) merged with `settings` (the same, from `up`'s generated options).

    Raises ValueError for an item without "=", an unknown TrainConfig setting, one of NOT_SETTABLE (use `up`'s own
    option), a key given twice (in --set, or both as an option and in --set), or a value the field refuses.
    """
    from trainer.cli_settings import collect, parse_set

    extra = collect(parse_set(items, exclude=NOT_SETTABLE))
    for key, value in (settings or {}).items():
        if key in extra:
            raise ValueError(f"{key} given twice: as --{key.replace('_', '-')} and as --set {key}")
        extra[key] = value
    return extra


def clear_folder(out: Path) -> None:
    """Remove what an earlier `up` wrote in `out` (its files and the runs named in its settings); `logs/` and
    anything else stay."""
    names = {"adamw", *(read_json(out / UP_SETTINGS) or {}), (read_json(out / "summary.json") or {}).get("optimizer")}
    for name in [*_UP_FILES, *filter(None, names)]:
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()



def disk_use(folder: Path) -> dict[str, int]:
    """Bytes under each entry of `folder` (files count their size; links are not followed)."""
    sizes = {}
    for entry in sorted(Path(folder).iterdir()):
        files = [entry] if not entry.is_dir() else [p for p in entry.rglob("*") if p.is_file()]
        sizes[entry.name] = sum(p.lstat().st_size for p in files)
    return sizes


