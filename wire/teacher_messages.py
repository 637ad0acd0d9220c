"""Teacher rounds: `TeacherTask` (trainer -> worker, a Celery task by name) and the Redis key its
answer lands under. Strict, frozen, versioned pydantic models on wire.messages' base; torch-free.

A task names one batch of one rank: its token ids (B, T) travel as little-endian uint32 in base64 (B * T * 4
bytes, 32 KiB for 16 x 512), the teacher by its folder and sha256 (published once; workers load it once per
sha256), and the target recipe (kind, k, temperature, seed). The batch counter `key` is
trainer.kd.teacher.batch_key(x): the in-process teacher seeds its sampled ids with the same counter, so the
fleet's targets equal the in-process ones for the same seed, device and dtype. The worker answers by SET NX of
a wire.kd_targets blob under `target_key(run, rank, recipe, key)`: a redelivered task (a worker killed mid-window)
writes nothing twice.
"""

from __future__ import annotations

import base64
from typing import Annotated, Literal

from pydantic import Field, model_validator

from wire.bounds import KDIds
from wire.messages import Message, Part, RunId, Sha256Hex

TEACHER_TASK_NAME = "sparecycles.teacher"
MAX_TEACHER_TOKENS = 1 << 20  # one batch's B * T: far above 16 x 512; a task over it is refused
TARGET_TTL_S = 3600  # an unread target blob expires (a trainer that died leaves nothing behind for long)
ROUND_TTL_S = 600.0  # a round queued this long unanswered is dropped by the worker that takes it (Celery `expires`):
# its step has trained (on CE alone) long before; a fill re-sends what stayed unanswered
TEACHER_QUEUE_PREFIX = "sparecycles.teacher"  # a run's teacher rounds go to "<prefix>.<run>" (fleet.teacher)
TARGET_KEY_PREFIX = "sc:kd:"  # every target blob's key starts so (target_key); workers may only write under it


def recipe_tag(kind: str, k: int, temperature: float, seed: int) -> str:
    """The target recipe (estimator kind, ids per position, temperature, seed) as a key part, e.g.
    "sampled16-t1.0-s0": two runs that share a run name and a batch but not a recipe never read each other's blob."""
    return f"{kind}{k}-t{float(temperature)!r}-s{seed}"


def target_key(run: str, rank: int, recipe: str, key: int) -> str:
    """The Redis key of the target blob of batch counter `key` (an unsigned 64-bit int) of `rank` in `run`, made
    with `recipe` (recipe_tag): a blob left by a run of another recipe (its window sent past its last step, an
    hour's TTL) is never taken for this one's."""
    return f"{TARGET_KEY_PREFIX}{run}:{rank}:{recipe}:{key:016x}"


class StudentTokenizer(Part):
    """The student's tokenizer as a worker that asks a serving engine checks it: its name
    (trainer.data.model_tokenizer's) and its ids of each of trainer.kd.teacher.ENGINE_PROBE_TEXTS, in order."""

    name: Annotated[str, Field(min_length=1, max_length=4096)]
    ids: Annotated[list[Annotated[list[Annotated[int, Field(ge=0, lt=1 << 32)]], Field(max_length=1024)]],
                   Field(min_length=1, max_length=64)]


class TeacherTask(Message):
    """One teacher round: targets for one batch. Raises pydantic.ValidationError for any field out of range,
    ids whose base64 does not decode to B * T uint32 values, or B * T above MAX_TEACHER_TOKENS.

    `student_tokenizer` and `teacher_vocab` (the teacher's logit width: its config.json vocab_size) are what a
    worker that answers through a serving engine needs (probe_worker.engine_teacher), which never loads the
    teacher; a worker that loads it reads both from the folder."""

    run: RunId
    teacher_dir: Annotated[str, Field(min_length=1, max_length=4096)]
    teacher_sha256: Sha256Hex
    rank: Annotated[int, Field(ge=0, le=65535)]
    step: Annotated[int, Field(ge=0, le=1 << 40)]
    key: Annotated[int, Field(ge=0, lt=1 << 64)]
    batch: Annotated[int, Field(ge=1, le=4096)]
    seq_len: Annotated[int, Field(ge=1, le=65536)]
    ids_b64: Annotated[str, Field(min_length=4, max_length=MAX_TEACHER_TOKENS * 6)]
    kind: Literal["sampled", "topk"]
    k: KDIds
    temperature: Annotated[float, Field(gt=0, le=100.0)]
    seed: Annotated[int, Field(ge=0, lt=1 << 63)]
    student_tokenizer: StudentTokenizer | None = None
    teacher_vocab: Annotated[int, Field(ge=1, le=1 << 32)] | None = None

    @model_validator(mode="after")
    def _ids_fit(self) -> TeacherTask:
        if self.batch * self.seq_len > MAX_TEACHER_TOKENS:
            raise ValueError(f"teacher batch {self.batch} x {self.seq_len} above {MAX_TEACHER_TOKENS} tokens")
        if len(self.ids_raw()) != 4 * self.batch * self.seq_len:
            raise ValueError(f"ids_b64 does not hold {self.batch} x {self.seq_len} uint32 token ids")
        return self

    @property
    def recipe(self) -> str:
        """recipe_tag of this round's kind, k, temperature and seed (its answer's target_key part)."""
        return recipe_tag(self.kind, self.k, self.temperature, self.seed)

    def ids_raw(self) -> bytes:
        """The batch's token ids as little-endian uint32 bytes (B * T * 4); b'' when the base64 is malformed."""
        try:
            return base64.b64decode(self.ids_b64, validate=True)
        except ValueError:
            return b""


# ---- The teacher's weights as coordinator blobs, and a teacher run registered at the coordinator ----
# A worker that cannot read the round's teacher_dir (another machine) rebuilds the folder from the coordinator's
# blob store (`GET /v1/blobs/{sha256}`, as weight versions are delivered): the files teacher_sha256 covers
# (config.json and the weight files), each one blob named by its sha256.
MAX_TEACHER_FILE_BYTES = 1 << 40
TeacherFileName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")]  # a bare name: no path


class TeacherFile(Part):
    """One file of a teacher folder: its name, byte length and sha256 (its coordinator blob's name)."""

    name: TeacherFileName
    size: Annotated[int, Field(ge=0, le=MAX_TEACHER_FILE_BYTES)]
    sha256: Sha256Hex


class TeacherManifest(Message):
    """A teacher as coordinator blobs: its sha256 (trainer.kd.teacher.teacher_sha256 of the folder) and its files.
    Raises pydantic.ValidationError for repeated file names or a folder without config.json."""

    teacher_sha256: Sha256Hex
    files: Annotated[list[TeacherFile], Field(min_length=1, max_length=4096)]

    @model_validator(mode="after")
    def _names(self) -> TeacherManifest:
        names = [f.name for f in self.files]
        if len(set(names)) != len(names) or "config.json" not in names:
            raise ValueError(f"teacher files must be distinct and hold config.json, got {names[:8]}")
        return self

    @property
    def nbytes(self) -> int:
        """The folder's bytes (sum of its files')."""
        return sum(f.size for f in self.files)


class TeacherRun(Message):
    """`POST /v1/teachers` body: a run's teacher rounds, registered at the coordinator (admin). `run` names the
    queue (teacher_queue(run)) that every worker then consumes (its heartbeat's teacher_queues, its broker user
    granted exactly that queue); `teacher` is the teacher its rounds name, its files already uploaded as blobs."""

    run: RunId
    teacher: TeacherManifest


def teacher_queue(run: str) -> str:
    """The Celery queue of `run`'s teacher rounds."""
    return f"{TEACHER_QUEUE_PREFIX}.{run}"
