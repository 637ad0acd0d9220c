"""`sparecycles up`, before anything starts: validate every option and decide what happens to the run folder.

`plan_up` returns an `UpPlan` (both runs' configs, the folder, what each run's sub-folder holds, warnings)
or raises ValueError; it trains nothing and starts no process. `sparecycles.up.run_up` carries a plan out.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sparecycles.up_options import SERVING_JSON, UpOptions, split_given
from trainer.preflight import input_warning, no_probe_round_warning
from trainer.run_options import UP_FLEET_WAIT, RunOptions

UP_SETTINGS = "up_settings.json"
# Settings that name a non-default `up` folder: runs/up-<preset>-<optimizer>[-steps5][-k4][-b8][-t16][-ci4]
# (and -serving-vllm after them for `--serving vllm`: _folder).
_NAME_TAGS = {"steps": "steps", "probes": "k", "batch_size": "b", "seq_len": "t", "curvature_interval": "ci"}
# What `--overwrite` removes from an `up` folder (besides the runs' own folders); never anything else there.
_UP_FILES = (UP_SETTINGS, "summary.json", "loss_curves.png", "curves.png", SERVING_JSON, "blobs", "valkey")


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
    fleet_wait: str = UP_FLEET_WAIT  # when the ZO run waits for its rounds (trainer.run_options.FLEET_ROUNDS)
    eval_deadline: float = 120.0  # seconds without a result before the trainer evaluates a version itself
    nproc: int | None = None  # the trainer's ranks under torchrun (`--nproc-per-node`); None: in `up`'s process
    serving: Any = None  # sparecycles.up_options.ServingDemo: the engine and request load beside the workers (--serving)

    @property
    def teacher_rounds(self) -> bool:
        """Whether the runs' `--teacher` answers on the fleet (the workers' teacher rounds, fleet.teacher): a sparse
        estimator (sampled, topk), in `up`'s process or under torchrun (each rank sends its own rows' rounds).
        Otherwise (--kd-estimator full) the teacher runs in the trainer."""
        cfg = self.zo_cfg
        return cfg.teacher is not None and cfg.kd_estimator != "full"

    @property
    def settings(self) -> dict[str, dict]:
        """Both runs' settings (trainer.preflight.run_settings, the fleet-probed run's with its probes' source, plus
        where they are evaluated and the ZO run's wait policy), as written to `up_settings.json`."""
        from trainer.preflight import run_settings

        evaluation = {"eval_on": self.eval_on, "eval_windows": self.eval_windows if self.eval_on == "fleet" else None}
        return {"adamw": {**run_settings(self.base_cfg), **evaluation},
                self.optimizer: {**run_settings(self.zo_cfg, self.fleet_wait), **evaluation,
                                 "fleet_wait": self.fleet_wait}}


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


def plan_up(*, settings: dict | None = None, train_options: tuple[str, ...] = (), optimizer_options: dict | None = None,
            placement: Any = None, **given: Any) -> UpPlan:
    """Validate every option of `up` and decide what happens to its run folder; starts and trains nothing.

    `given`: fields of sparecycles.up_options.UpOptions (preset, task, optimizer, workers, run_dir, ...), of
    trainer.run_options.RunOptions that `up` takes (eval_on, eval_windows, eval_deadline, fleet_wait: unset is
    `interval`, `up`'s exact-resume mode; nproc_per_node: each run under torchrun with that many ranks; overwrite)
    and of TrainConfig (steps, curvature_interval, ...: settings of both runs, as in `settings`), each by name.
    `settings`: TrainConfig overrides of both runs (`up`'s generated options); `train_options` ("KEY=VALUE", `up
    --set`) any other TrainConfig field of both runs; a setting given twice is refused. `optimizer_options`: the
    fleet-probed run's optimizer knobs (`--optimizer-option`); each adds -KEY-VALUE to the folder name.
    `placement`: fleet.devices.Placement (the trainer's device, one device per worker); None: all on the CPU.
    The folder is `run_dir`, else `runs/up-<preset>-<optimizer>` plus a tag per setting that differs from the
    preset's (`-steps5`, `-k4`, `-b8`, `-t16`, `-ci4`; another `--model`: its name, then `--data`'s file or folder
    name, first, e.g. up-demo-zocurv-line-my-llama-my_texts; `--serving vllm` adds -serving-vllm, so a plain `up`
    never reuses a folder holding serving.json), so runs with other settings get other folders.
    Raises ValueError (message names the option) for an invalid option (more ranks than CUDA devices, a batch
    the ranks cannot split, --eval-on fleet with N > 1, --serving vllm without the vLLM venv included), or when
    the folder holds a run with other settings and `overwrite` is not set (the message lists the differences);
    TypeError for an unknown keyword.
    """
    from pydantic import ValidationError

    from sparecycles.up_serving import check_engine
    from trainer.launch import check_ranks
    from trainer.preflight import explain

    up_kw, run_kw, cfg_kw = split_given(given)
    try:
        opts, run = UpOptions(**up_kw), RunOptions(**run_kw, fleet=True)
    except ValidationError as exc:
        raise ValueError(explain(exc)) from None
    both = set(cfg_kw) & set(settings or {})
    if both:
        raise ValueError(f"{', '.join(sorted(both))} given twice")
    optimizer = opts.fleet_optimizer
    _check_fleet_optimizer(optimizer, opts.task)
    check_engine(opts.serving_demo)
    device = None if placement is None or placement.trainer == "cpu" else placement.trainer
    eval_on = run.eval_on
    if run.nproc_per_node is not None:
        device, eval_on = _rank_placement(run.nproc_per_node, device, eval_on)
    over = {"task": opts.task, "device": device, **parse_train_options(train_options, {**cfg_kw, **(settings or {})})}
    from_set = set(over) - set(cfg_kw) - set(settings or {}) - {"task", "device"}
    base_cfg, zo_cfg, default = _run_configs(opts.preset_for_task, over, optimizer, optimizer_options, from_set)
    if run.nproc_per_node is not None:
        check_ranks(run.nproc_per_node, (base_cfg, zo_cfg))
    out = _folder(opts, zo_cfg, default, optimizer_options)
    fleet_wait = run.fleet_wait or UP_FLEET_WAIT
    workers = tuple(placement.workers) if placement is not None else ()
    plan = UpPlan(opts.task, opts.preset_for_task, optimizer, len(workers) or opts.workers, out,
                  base_cfg.model_copy(update={"run_dir": out / "adamw"}),
                  zo_cfg.model_copy(update={"run_dir": out / optimizer}), {}, False,
                  tuple(w for w in [no_probe_round_warning(zo_cfg, fleet_wait), input_warning(zo_cfg)] if w), workers,
                  eval_on="trainer" if eval_on == "trainer" else "fleet", eval_windows=run.eval_windows,
                  fleet_wait=fleet_wait, eval_deadline=run.eval_deadline, nproc=run.nproc_per_node,
                  serving=opts.serving_demo)
    return _with_folder_states(plan, run.overwrite)


def _run_configs(preset: str, over: dict[str, Any], optimizer: str, optimizer_options: dict | None,
                 from_set: set[str]) -> tuple[Any, Any, Any]:
    """(AdamW's config, the fleet-probed run's, the preset's default for the folder name), each checked
    (trainer.preflight.check_options; a teacher folder and its tokenizer too). Raises ValueError naming the option
    (`--set KEY` for those in `from_set`)."""
    from trainer.config import resolve_preset
    from trainer.preflight import check_options, explain

    _plan_checked(preset, over, optimizer, optimizer_options, from_set)
    try:
        if over["task"] != "sentiment" and "staleness" not in over:
            # A fleet answers a round while the trainer moves on; versions advance with steps, so the staleness
            # bound must cover the rounds' round trip: two curvature intervals. The one place this default is
            # set; TrainConfig.staleness's description (train/up --help) says it.
            over = {**over, "staleness": 2 * resolve_preset(preset, over).curvature_interval}
        zo_cfg = resolve_preset(preset, {**over, "optimizer": optimizer,
                                         **({"optimizer_options": optimizer_options} if optimizer_options else {})})
        base_cfg = resolve_preset(preset, {**over, "optimizer": "adamw"})
        default = resolve_preset(preset, {"task": over["task"], "optimizer": optimizer})
    except ValueError as exc:  # pydantic's ValidationError is one; so is an unknown preset
        raise ValueError(explain(exc)) from None
    check_options(zo_cfg)  # _plan_checked ran these with --set names: here they pass
    check_options(base_cfg)
    if zo_cfg.teacher is not None:  # before any process starts: the method, the teacher folder and its tokenizer
        from trainer.kd.teacher import check_teacher_run

        check_teacher_run(zo_cfg, fleet=True)
    return base_cfg, zo_cfg, default


def _folder(opts: UpOptions, zo_cfg: Any, default: Any, optimizer_options: dict | None) -> Path:
    """`up`'s run folder: --run-dir, else runs/up-<preset>-<optimizer> and a tag per setting that differs from the
    preset's, and -serving-<engine> with --serving (plan_up). Raises ValueError for a --run-dir that is a file or a
    `train` run folder (its summary.json would be replaced, or deleted by --overwrite)."""
    from trainer.paths import runs_dir

    tags = [f"{tag}{getattr(zo_cfg, f)}" for f, tag in _NAME_TAGS.items() if getattr(zo_cfg, f) != getattr(default, f)]
    tags += [f"{k}-{v}" for k, v in sorted((optimizer_options or {}).items())]
    if zo_cfg.data is not None:  # --data PATH: named by its file or folder name, as `train`'s run folders are
        tags.insert(0, re.sub(r"[^A-Za-z0-9._-]+", "-", Path(zo_cfg.data.rstrip("/")).stem).strip("-.") or "data")
    if zo_cfg.model != default.model:  # --model DIR: named by the folder's name
        from trainer.models.causal_lm import model_label

        tags.insert(0, model_label(zo_cfg.model))
    if opts.serving != "none":  # --serving vllm: its folder holds serving.json; a plain `up` must not reuse it
        tags.append(f"serving-{opts.serving}")
    if other := _other_settings(zo_cfg, opts.preset_for_task):  # any other setting (--teacher, --lr, --set ...): a short digest
        tags.append("x" + hashlib.sha256(json.dumps(other, sort_keys=True, default=str).encode()).hexdigest()[:6])
    name = "-".join(["up", opts.preset_for_task, opts.fleet_optimizer, *tags])
    out = (Path(opts.run_dir) if opts.run_dir else runs_dir() / name).resolve()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--run-dir {out} exists and is not a folder")
    if (out / "config.json").is_file():  # up writes summary.json (and with --overwrite clears it) at its top
        raise ValueError(f"--run-dir {out} is a `sparecycles train` run folder (it holds config.json), not an `up` "
                         "folder; nothing was changed. Pass another --run-dir")
    return out


# Named in the folder already (tags, --model, --data, the optimizer), or not a setting of the run's numbers' kind that
# differs by default (the device the machine has; staleness, which follows --curvature-interval unless given).
_UNNAMED = (*_NAME_TAGS, "model", "data", "run_dir", "optimizer", "optimizer_options", "task", "device")


def _other_settings(zo_cfg: Any, preset: str) -> dict[str, Any]:
    """The fleet run's settings that differ from `preset`'s given the tagged ones (a setting derived from a tagged
    one, as warmup from --steps, follows it) and that no folder tag names ({field: value}): two `up` commands that
    differ only there get two folders, never one holding the other's run."""
    from trainer.config import resolve_preset

    tagged = {k: getattr(zo_cfg, k) for k in ("task", "optimizer", *_NAME_TAGS)}
    ours, theirs = zo_cfg.model_dump(mode="json"), resolve_preset(preset, tagged).model_dump(mode="json")
    other = {k: v for k, v in ours.items() if k not in _UNNAMED and v != theirs.get(k)}
    if other.get("staleness") == 2 * zo_cfg.curvature_interval:
        other.pop("staleness")
    return other


def _with_folder_states(plan: UpPlan, overwrite: bool) -> UpPlan:
    """`plan` with what each run's sub-folder holds (`states`), or cleared with `overwrite`. Raises ValueError for a
    corrupt checkpoint of a run to resume, or a folder holding a run with other settings without `overwrite`."""
    from trainer.preflight import FolderState, folder_state

    out = plan.out
    states = {"adamw": folder_state(plan.base_cfg.run_dir, plan.base_cfg),  # the other's probes: the fleet's
              plan.optimizer: folder_state(plan.zo_cfg.run_dir, plan.zo_cfg, plan.fleet_wait)}
    plan = replace(plan, states=states)
    if overwrite:
        return replace(plan, clear=True, states={k: FolderState("empty") for k in states})
    from trainer.checkpoint import checkpoint_problem

    for name, state in states.items():  # a corrupt checkpoint fails here, in one line, before any process starts
        if state.kind == "resume" and (problem := checkpoint_problem(out / name / "checkpoint.safetensors")):
            raise ValueError(problem)
    diffs = _folder_diffs(out, plan.settings, states)
    if diffs:
        raise ValueError(f"{out} holds a run with other settings ({'; '.join(diffs)}); nothing was changed. "
                         "Pass --overwrite to replace it, or another --run-dir (without --run-dir, the default "
                         "folder name carries --steps, --probes, --batch-size, --seq-len, --curvature-interval, --serving "
                         "and a digest of any other setting)")
    return plan


def _set_names(message: str, from_set: set[str]) -> str:
    """`message` (option errors: "--seq-len: ...", "--corpus: ...") with each setting that came from `up --set`
    named as the user wrote it: "--set seq_len" (an error names what the user typed)."""
    import re

    for key in sorted(from_set, key=len, reverse=True):
        message = re.sub(rf"--{re.escape(key.replace('_', '-'))}(?![\w-])", f"--set {key}", message)
    return message


def _plan_checked(preset: str, over: dict[str, Any], optimizer: str, optimizer_options: dict | None,
                  from_set: set[str]) -> None:
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
    more ranks than CUDA devices or CUDA where none is visible (trainer.launch.launch_backend); --eval-on fleet with
    more than one rank is RunOptions' to refuse."""
    from trainer.launch import launch_backend

    launch_backend(nproc, device)
    if nproc == 1:
        return device, eval_on
    return ("cuda" if device and device.startswith("cuda") else device), "trainer"


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


