"""A folder of teacher targets computed ahead of time (offline precompute), and the loss that reads it.

`sparecycles kd fill` (fleet.kd_fill) sends the teacher rounds of a planned run to teacher workers and stores each
step's answer here; `train --teacher ... --kd-cache DIR` reads them instead of asking a teacher (`CacheTargets`).

Layout: ROOT/KEY/plan.json and ROOT/KEY/{step:07d}.kd, one blob per 0-based step: the exact bytes of
wire.kd_targets.encode (a `sampled/1` or `topk/1` safetensors blob, (B, T, K) ids and log-probs). KEY is the
sha256 (hex) of the plan's content fields (`KDPlan.content`): teacher sha256, the training split's sha256, batch
size, sequence length, seed, rank and the target recipe (kind, k, temperature). The plan's `steps` (how many steps
a fill covered) is not part of the key: step s's targets do not depend on how long the run is, so a longer fill of
the same plan adds steps to the same folder and a shorter run reads a prefix of it. Files are written atomically
(a temporary file in the same folder, then rename), so an interrupted fill keeps every step it stored, whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from trainer.kd.sparse_loss import SparseKDLoss, intake_step, whole_batches
from trainer.kd.teacher import batch_key, teacher_sha256
from trainer.ledger import phase
from trainer.metrics import KD_MISSING, KD_REJECTED
from wire.bounds import KDIds
from wire.kd_targets import KDTargets

PLAN_FILE = "plan.json"
SUFFIX = ".kd"


class CachePlanError(ValueError):
    """A target cache that does not hold this run's plan (message names the differing field), or a bad plan."""


class KDPlan(BaseModel):
    """What decides a run's teacher targets: the batches (data, batch_size, seq_len, seed, rank) and the recipe.

    teacher_sha256: trainer.kd.teacher.teacher_sha256 (hex); data: the corpus / --data label (informative);
    data_sha256: sha256 (hex) of the training split's token file from the data manifest; batch_size: sequences
    per step (B); seq_len: tokens per sequence (T); seed: the run's batch seed; rank: the data rank (0 outside
    torchrun); kind: sampled or topk; k: entries per position (K); temperature: the teacher's softmax temperature
    (> 0); steps: how many steps [0, steps) the fill planned (not part of the key)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    teacher_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    data: str
    data_sha256: str = Field(min_length=1)
    batch_size: int = Field(ge=1)
    seq_len: int = Field(ge=1)
    seed: int
    rank: int = Field(0, ge=0)
    kind: Literal["sampled", "topk"]
    k: KDIds
    temperature: float = Field(gt=0)
    steps: int = Field(ge=0)

    CONTENT: ClassVar[tuple[str, ...]] = ("teacher_sha256", "data_sha256", "batch_size", "seq_len", "seed", "rank", "kind", "k", "temperature")

    def content(self) -> dict[str, Any]:
        """The fields the key hashes (every field but `data`, a label, and `steps`, the extent)."""
        return {f: getattr(self, f) for f in self.CONTENT}

    def key(self) -> str:
        """sha256 (hex) of `content()` as sorted-key JSON: the cache sub-folder of this plan."""
        return hashlib.sha256(json.dumps(self.content(), sort_keys=True).encode()).hexdigest()

    def differences(self, other: KDPlan) -> list[str]:
        """`field mine != other's` for each content field that differs (empty: same targets)."""
        return [f"{f} {getattr(self, f)!r} != {getattr(other, f)!r}" for f in self.CONTENT
                if getattr(self, f) != getattr(other, f)]


def data_sha256(task: Any) -> tuple[str, str]:
    """(label, sha256 of the training split) of an LM task (trainer.tasks.LMTask): its corpus manifest's
    splits.train.sha256 (a built corpus and a --data build both record it). Raises CachePlanError when the task
    has no such manifest (e.g. the sentiment task)."""
    corpus = getattr(task, "corpus", None)
    try:
        return str(task.data_name), str(corpus.manifest["splits"]["train"]["sha256"])  # type: ignore[union-attr]
    except (AttributeError, KeyError, TypeError):
        raise CachePlanError(f"task {type(task).__name__} has no data manifest with a train split sha256: "
                             "a target cache needs the lm task") from None


def plan_for(cfg: Any, task: Any, *, steps: int | None = None, rank: int = 0) -> KDPlan:
    """The KDPlan of run settings `cfg` (trainer.config.TrainConfig, with teacher set and kd_estimator sampled or
    topk) on `task`; steps default cfg.steps. Raises CachePlanError for no teacher or the full estimator, and
    trainer.kd.teacher.TeacherMismatchError for a teacher folder that is not one."""
    if cfg.teacher is None or cfg.kd_estimator == "full":
        raise CachePlanError(f"a target cache needs --teacher and --kd-estimator sampled or topk (got teacher "
                             f"{cfg.teacher!r}, {cfg.kd_estimator})")
    label, sha = data_sha256(task)
    return KDPlan(teacher_sha256=teacher_sha256(cfg.teacher), data=label, data_sha256=sha,
                  batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed, rank=rank, kind=cfg.kd_estimator,
                  k=cfg.kd_k, temperature=float(cfg.kd_temperature), steps=cfg.steps if steps is None else steps)


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def whole_blob_file(path: Path) -> bool:
    """Whether `path` holds a whole safetensors blob: its size is 8 + the header length + the largest tensor end
    offset the header names (safetensors' layout). Reads the header only; False for a missing or unreadable file,
    a header that is not JSON, or any other size."""
    try:
        with path.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > 1 << 16:
                return False
            header = json.loads(fh.read(n))
        end = max((int(t["data_offsets"][1]) for name, t in header.items() if name != "__metadata__"), default=0)
        return path.stat().st_size == 8 + n + end
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error):
        return False


class TargetCache:
    """The target blobs of one plan: ROOT/KEY/{step:07d}.kd plus ROOT/KEY/plan.json.

    `TargetCache(root)` is the whole cache (no plan yet); `open(plan)` returns the cache of that plan, creating
    its folder and writing plan.json (steps = the largest planned so far). Steps are 0-based ints >= 0; blobs are
    bytes (wire.kd_targets.encode's). Methods on a plan-less cache raise CachePlanError."""

    def __init__(self, root: Path | str, plan: KDPlan | None = None) -> None:
        self.root, self.plan = Path(root).expanduser(), plan
        self.dir = self.root / plan.key() if plan is not None else None

    @staticmethod
    def key_for(plan: KDPlan) -> str:
        """The sub-folder name (sha256 hex) of `plan` (KDPlan.key)."""
        return plan.key()

    def open(self, plan: KDPlan) -> TargetCache:
        """The cache of `plan` under this root, its folder created and plan.json written (steps: the larger of
        plan.steps and the stored plan's). Raises OSError when the root cannot be written."""
        cache = TargetCache(self.root, plan)
        assert cache.dir is not None
        cache.dir.mkdir(parents=True, exist_ok=True)
        stored = cache.stored_plan()
        if stored is None or stored.steps < plan.steps:
            _atomic_write(cache.dir / PLAN_FILE, plan.model_dump_json(indent=2).encode())
        elif stored is not None:
            cache.plan = plan.model_copy(update={"steps": stored.steps})
        return cache

    def plans(self) -> list[KDPlan]:
        """Every readable plan.json under the root (one per key folder)."""
        out = []
        for p in sorted(self.root.glob(f"*/{PLAN_FILE}")) if self.root.is_dir() else []:
            try:
                out.append(KDPlan.model_validate_json(p.read_text()))
            except (OSError, ValueError):
                continue
        return out

    def stored_plan(self) -> KDPlan | None:
        """This plan's plan.json as stored (None when absent or unreadable)."""
        try:
            return KDPlan.model_validate_json((self._dir() / PLAN_FILE).read_text())
        except (OSError, ValueError):
            return None

    def _dir(self) -> Path:
        if self.dir is None:
            raise CachePlanError(f"target cache {self.root}: no plan opened (TargetCache.open(plan))")
        return self.dir

    def path(self, step: int) -> Path:
        """The file of 0-based `step`. Raises CachePlanError for a negative step."""
        if step < 0:
            raise CachePlanError(f"step {step} < 0")
        return self._dir() / f"{step:07d}{SUFFIX}"

    def has(self, step: int) -> bool:
        """Whether `step`'s blob is stored whole (whole_blob_file)."""
        return whole_blob_file(self.path(step))

    def get(self, step: int) -> bytes | None:
        """`step`'s blob (bytes), or None when it is not stored."""
        try:
            return self.path(step).read_bytes()
        except FileNotFoundError:
            return None

    def put(self, step: int, blob: bytes) -> None:
        """Store `blob` (non-empty bytes) as `step`'s targets, atomically (a reader sees the old file or the
        whole new one). Raises CachePlanError for an empty blob, OSError when the folder cannot be written."""
        if not blob:
            raise CachePlanError(f"step {step}: an empty target blob")
        _atomic_write(self.path(step), bytes(blob))

    def missing(self, steps: Iterable[int]) -> list[int]:
        """The steps of `steps` not stored whole, in the order given: a file cut short (a copy that stopped, a full
        disk) is missing, so a fill asks for it again."""
        have = {p.name for p in self._dir().glob(f"*{SUFFIX}")} if self._dir().is_dir() else set()
        return [s for s in steps if f"{s:07d}{SUFFIX}" not in have or not whole_blob_file(self.path(s))]


def open_for_run(root: Path | str, plan: KDPlan) -> TargetCache:
    """The cache `train --kd-cache ROOT` reads for `plan`. ROOT may be the cache root (the plan's key folder is
    used) or a key folder itself (holding plan.json). Raises CachePlanError, naming the differing fields, when
    the stored plan (the key folder's, or with no folder of this key the closest plan under the root) differs, or
    when the root holds no plan at all."""
    root = Path(root).expanduser()
    if (root / PLAN_FILE).is_file():  # a key folder given directly
        try:
            stored = KDPlan.model_validate_json((root / PLAN_FILE).read_text())
        except (OSError, ValueError) as e:
            raise CachePlanError(f"--kd-cache {root}: unreadable {PLAN_FILE} ({e})") from None
        diffs = plan.differences(stored)
        if diffs:
            raise CachePlanError(f"--kd-cache {root} holds another plan: {'; '.join(diffs)} (this run's != cache's)")
        cache = TargetCache(root.parent, plan.model_copy(update={"steps": stored.steps}))
        cache.dir = root  # the folder given, whatever its name
        return cache
    cache = TargetCache(root, plan)
    stored = cache.stored_plan()
    if stored is not None:
        return TargetCache(root, plan.model_copy(update={"steps": stored.steps}))
    plans = TargetCache(root).plans()
    if not plans:
        raise CachePlanError(f"--kd-cache {root} holds no target plan: fill it first (sparecycles kd fill ...)")
    closest = min(plans, key=lambda p: len(plan.differences(p)))
    raise CachePlanError(f"--kd-cache {root} holds no targets of this run's plan: "
                         f"{'; '.join(plan.differences(closest))} (this run's != cache's)")


class CacheTargets:
    """The targets stored in a TargetCache, a targets source of trainer.kd.sparse_loss.SparseKDLoss (as the
    fleet's teacher rounds are, from the same bytes): a step whose blob is absent or rejected trains on CE alone
    (counted in sparecycles_trainer_kd_missing_steps, reported through trainer.health as teacher_missing). The
    step of a batch x (int64 (B, T)) is found by its batch_key among the next `window` steps' batches
    (batch_fn(step) -> (x, y), the task's own). Raises ValueError for window < 1."""

    def __init__(self, cache: TargetCache, batch_fn: Callable, *, run: str, window: int = 8) -> None:
        if window < 1:
            raise ValueError(f"cache window {window} must be >= 1")
        self.cache, self.batch_fn, self.run, self.window = cache, batch_fn, run, window
        self.next_step = 0
        self._keys: dict[int, int] = {}  # batch key -> step for steps [next_step, next_step + window)
        self.taken = self.missing = self.bytes_read = 0
        for counter in (KD_MISSING, KD_REJECTED):
            counter.labels(run)

    def seek(self, step: int) -> None:
        """Start at 0-based `step` (0, or a resume's checkpointed step)."""
        self.next_step, self._keys = step, {}

    def _step_of(self, key: int) -> int | None:
        for s in range(self.next_step, self.next_step + self.window):
            if s not in self._keys.values():
                self._keys[batch_key(self.batch_fn(s)[0])] = s
        step = self._keys.get(key)
        if step is not None:
            self.next_step = step + 1
            self._keys = {k: s for k, s in self._keys.items() if s > step}
        return step

    def take(self, x: torch.Tensor, vocab: int) -> KDTargets | None:
        """The stored targets of batch x (B, T) for a student of `vocab` ids; None (counted) when missing."""
        with phase("kd"):
            step = self._step_of(batch_key(x))
            blob = self.cache.get(step) if step is not None else None
            self.bytes_read += len(blob) if blob is not None else 0
            why = "not in the target cache" if step is not None else "batch not in the plan"
            targets = intake_step(blob, x, vocab, run=self.run, step=step, why=why)
            self.taken, self.missing = self.taken + (targets is not None), self.missing + (targets is None)
            return targets

    def stats(self) -> dict[str, int]:
        """{kd_taken_steps, kd_missing_steps, kd_cache_bytes}: steps that read targets, steps on CE alone, bytes
        of blobs read from the cache."""
        return {"kd_taken_steps": self.taken, "kd_missing_steps": self.missing, "kd_cache_bytes": self.bytes_read}


def kd_cache_factory(root: Path | str, *, window: int = 8) -> Callable:
    """trainer.train's `kd_loss_factory` for `train --kd-cache ROOT`: (cfg, task, rank, batch_fn=None) ->
    SparseKDLoss over the cache of the plan of (cfg, task, rank) (batch_fn(step): the rank's batch as trained,
    (x, y) or MicroBatches; default task.batch) (open_for_run: raises CachePlanError naming a differing field)."""

    def build(cfg: Any, task: Any, rank: int, batch_fn: Callable | None = None) -> SparseKDLoss:
        mine = plan_for(cfg, task, rank=rank)
        cache = open_for_run(root, mine)
        run = f"kd-{mine.teacher_sha256[:12]}-{cfg.seed}"
        batch_fn = batch_fn or task.batch
        return SparseKDLoss(CacheTargets(cache, whole_batches(batch_fn), run=run, window=window), alpha=cfg.kd_alpha,
                            batch_fn=batch_fn)

    return build
