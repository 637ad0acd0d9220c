"""Teacher rounds answered by a serving engine: the model an inference engine already serves gives a
round's top-k targets through its OpenAI-compatible API, and this worker never loads a model.

One round (B rows of T ids) is one `POST /v1/completions` whose prompts are the rows' token ids, with
`prompt_logprobs=k` (positions 0..T-2: the engine's entry t+1 is the distribution given ids[:t+1]),
`max_tokens=1, temperature=0, logprobs=k` (position T-1: the first generated token's distribution given the whole
row) and `return_tokens_as_token_ids` (wire.engine_answers). Each position's k entries are checked (finite, <= 0,
ids below the teacher's vocabulary, exactly k once the prompt's or the sampled id the engine adds is dropped) and
written as the in-process top-k teacher writes them (trainer.kd.targets.make_targets, kind topk): ids in
descending log-probability, a `topk/1` blob (wire.kd_targets). At temperature 1 the log-probabilities are the
engine's own, the full-vocabulary log_softmax the in-process teacher stores; at another temperature tau they are
logp / tau renormalised over the k ids (the engine gives no normaliser over the rest), which changes nothing the
loss reads: the top-k estimator renormalises over the k ids (trainer.kd.estimators.sparse_ce).

Before a student's first round the engine's tokenizer is checked against the student's: the engine's
`/tokenize` of trainer.kd.teacher.ENGINE_PROBE_TEXTS must give the ids the round carries (TeacherTask
.student_tokenizer); a mismatch refuses the round naming both. When the engine's model folder (`GET /v1/models`'s
root) is readable here, its teacher_sha256 must be the round's. The engine's time: an answer later than
`timeout_s` is an engine error; the round stays unanswered and the trainer's step trains on CE alone (counted
missing there, as any unanswered round).
"""

from __future__ import annotations

import logging
import math
import time

import httpx
import numpy as np
import redis
import torch
from pydantic import ValidationError

from probe_worker.teacher_outcomes import TeacherRefused, TeacherUnanswered
from trainer.kd.teacher import ENGINE_PROBE_TEXTS, TeacherMismatchError, teacher_sha256
from wire.engine_answers import (
    CompletionAnswer,
    CompletionChoice,
    ModelCard,
    ModelList,
    TokenizeAnswer,
    token_id,
)
from wire.kd_targets import KDTargets, encode
from wire.teacher_messages import TARGET_TTL_S, StudentTokenizer, TeacherTask, target_key

log = logging.getLogger("sparecycles.worker.engine_teacher")


class EngineAnswerError(TeacherUnanswered):
    """The engine answered, but not with k finite log-probabilities <= 0 of ids in the vocabulary per position
    (or not in the expected shape): the round is not answered, counted as `engine_invalid`."""

    outcome = "engine_invalid"


class EngineUnavailable(TeacherUnanswered):
    """The engine did not answer in time, or answered an HTTP error: counted as `engine_error`."""

    outcome = "engine_error"


def position_topk(entries: dict[int, float], k: int, own: int, vocab: int, where: str,
                  ranks: dict[int, int | None] | None = None) -> list[tuple[int, float]]:
    """One position's top k (id, logprob) pairs, descending (ties by id), from the engine's entries (id ->
    logprob, nats; `ranks`: id -> the engine's 1-based rank, where it gives them).

    `own` is the id the engine adds when it is not among the k most probable (the prompt's next id, or the sampled
    one): with k + 1 entries it must be the least probable one, and is dropped. Raises EngineAnswerError for another
    count, an entry ranked above k, a non-finite or positive log-probability, or an id outside [0, vocab);
    `where` names the position in the message."""
    if len(entries) == k + 1 and own in entries and entries[own] <= min(entries.values()):
        entries = {i: lp for i, lp in entries.items() if i != own}
    if len(entries) != k:
        raise EngineAnswerError(f"{where}: {len(entries)} entries, expected k = {k} (or k + 1 with id {own} last)")
    for i, lp in entries.items():
        if not 0 <= i < vocab:
            raise EngineAnswerError(f"{where}: id {i} outside the teacher's vocabulary of {vocab}")
        if not (math.isfinite(lp) and lp <= 0.0):
            raise EngineAnswerError(f"{where}: log-probability {lp} of id {i} is not finite and <= 0")
        if ranks and (ranks.get(i) or 0) > k:
            raise EngineAnswerError(f"{where}: id {i} ranked {ranks[i]}, not among the k = {k} most probable")
    return sorted(entries.items(), key=lambda e: (-e[1], e[0]))


def row_topk(choice: CompletionChoice, row: list[int], k: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """One row's (T, k) ids (int64) and raw log-probabilities (float64) from its choice (wire.engine_answers).
    Raises EngineAnswerError (see position_topk), or for prompt_logprobs that are not T entries with the first
    null, or a missing generated-token distribution."""
    t = len(row)
    plp, gen = choice.prompt_logprobs, choice.logprobs
    if plp is None or len(plp) != t or plp[0] is not None or any(p is None for p in plp[1:]):
        raise EngineAnswerError(f"row {choice.index}: prompt_logprobs must be {t} entries, the first null")
    if gen is None or not gen.tokens or not gen.top_logprobs or gen.top_logprobs[0] is None:
        raise EngineAnswerError(f"row {choice.index}: no log-probabilities of the generated token")
    ids, lps = np.zeros((t, k), np.int64), np.zeros((t, k), np.float64)
    try:
        positions = [({token_id(i): e.logprob for i, e in p.items()}, row[n + 1],
                      {token_id(i): e.rank for i, e in p.items()}) for n, p in enumerate(plp[1:])]
        last = {token_id(i): lp for i, lp in gen.top_logprobs[0].items()}
        positions.append((last, token_id(gen.tokens[0]), None))
    except ValueError as exc:
        raise EngineAnswerError(f"row {choice.index}: {exc}") from None
    for n, (entries, own, ranks) in enumerate(positions):
        pairs = position_topk(entries, k, own, vocab, f"row {choice.index} position {n}", ranks)
        ids[n], lps[n] = [i for i, _ in pairs], [lp for _, lp in pairs]
    return ids, lps


def renormalised(lps: np.ndarray, temperature: float) -> np.ndarray:
    """The stored log-probabilities (module docstring): the engine's own at temperature 1, else lps / tau minus
    their logsumexp over the last axis (the k ids). lps: (..., k) float64, nats; returns float32."""
    if temperature == 1.0:
        return lps.astype(np.float32)
    z = lps / temperature
    m = z.max(-1, keepdims=True)
    return np.minimum(z - (m + np.log(np.exp(z - m).sum(-1, keepdims=True))), 0.0).astype(np.float32)


class EngineTeacher:
    """A teacher runtime (probe_worker.teacher.run_teacher's `runtime`) that asks the engine at `url`.

    `answer(task)` -> 'done' or 'duplicate'; raises TeacherRefused (a sampled round, a round without the student's
    tokenizer, a tokenizer or teacher that is not the engine's, a request the engine refuses as such: HTTP 400),
    ValueError (ids outside the teacher's vocabulary), EngineUnavailable and EngineAnswerError. Every HTTP call
    carries `timeout_s` (seconds)."""

    def __init__(self, url: str, store: redis.Redis, timeout_s: float = 60.0) -> None:
        self.url, self.store = url.rstrip("/"), store
        self.http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(timeout_s, connect=10.0))
        self.checked: dict[tuple, str] = {}  # (student name, ids) -> '' (same tokenizer) or the refusal
        self.teacher_ok: dict[str, str] = {}  # round's teacher sha256 -> '' or the refusal
        self._card: ModelCard | None = None
        self.fetched_bytes = 0  # never fetches weights (run_teacher reads it)
        self.last_tokens_per_s, self.last_bytes = 0.0, 0

    def _post(self, path: str, body: dict, model: type) -> object:
        try:
            r = self.http.post(path, json=body)
        except httpx.HTTPError as exc:
            raise EngineUnavailable(f"engine {self.url}{path}: {type(exc).__name__}: {str(exc)[:200]}") from None
        if r.status_code == 400:  # the engine refuses the request itself (e.g. k above its --max-logprobs)
            raise TeacherRefused(f"engine {self.url}{path} refused the request: {r.text[:300]}")
        if r.status_code != 200:
            raise EngineUnavailable(f"engine {self.url}{path}: HTTP {r.status_code}: {r.text[:200]}")
        try:
            return model.model_validate_json(r.content)
        except ValidationError as exc:
            raise EngineAnswerError(f"engine {self.url}{path}: unexpected answer: {str(exc)[:300]}") from None

    def card(self) -> ModelCard:
        """The engine's (first) served model, asked once (`GET /v1/models`)."""
        if self._card is None:
            try:
                r = self.http.get("/v1/models")
                r.raise_for_status()
                self._card = ModelList.model_validate_json(r.content).data[0]
            except httpx.HTTPError as exc:
                raise EngineUnavailable(f"engine {self.url}/v1/models: {str(exc)[:200]}") from None
            except ValidationError as exc:
                raise EngineAnswerError(f"engine {self.url}/v1/models: {str(exc)[:300]}") from None
        return self._card

    def check_tokenizer(self, student: StudentTokenizer) -> None:
        """Refuse (TeacherRefused, naming both) an engine whose /tokenize of ENGINE_PROBE_TEXTS differs from the
        student's ids; asked once per student tokenizer, the verdict kept."""
        key = (student.name, tuple(tuple(i) for i in student.ids))
        if key not in self.checked:
            name = self.card().id
            why = "" if len(student.ids) == len(ENGINE_PROBE_TEXTS) else (
                f"the round carries {len(student.ids)} probe texts' ids, this worker {len(ENGINE_PROBE_TEXTS)}")
            for text, want in zip(ENGINE_PROBE_TEXTS, student.ids, strict=False):
                got = self._post("/tokenize", {"model": name, "prompt": text, "add_special_tokens": False},
                                 TokenizeAnswer).tokens  # type: ignore[attr-defined]
                if not why and got != want:
                    why = (f"the engine's tokenizer ({name} at {self.url}) differs from the student's "
                           f"({student.name}): {text!r} is {got[:8]} there, {want[:8]} for the student")
            self.checked[key] = why
        if self.checked[key]:
            raise TeacherRefused(self.checked[key])

    def check_teacher(self, task: TeacherTask) -> None:
        """Refuse a round whose teacher is not the engine's model, when the engine's model folder is readable here
        (its teacher_sha256 differs from the round's); an unreadable folder is not a refusal."""
        if task.teacher_sha256 not in self.teacher_ok:
            root, why = self.card().root, ""
            try:
                found = teacher_sha256(root) if root else task.teacher_sha256
                if found != task.teacher_sha256:
                    why = (f"the engine at {self.url} serves {root} (teacher sha256 {found[:12]}), the round names "
                           f"teacher {task.teacher_dir} ({task.teacher_sha256[:12]})")
            except (TeacherMismatchError, OSError):
                log.info("engine model folder %s not readable here: its sha256 is not checked", root)
            self.teacher_ok[task.teacher_sha256] = why
        if self.teacher_ok[task.teacher_sha256]:
            raise TeacherRefused(self.teacher_ok[task.teacher_sha256])

    def targets(self, rows: list[list[int]], k: int, temperature: float, vocab: int) -> KDTargets:
        """The topk targets of `rows` (B lists of T ids): ids (B, T, k) int64, logp (B, T, k) float32."""
        body = {"model": self.card().id, "prompt": rows, "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": k, "logprobs": k, "return_tokens_as_token_ids": True}
        answer: CompletionAnswer = self._post("/v1/completions", body, CompletionAnswer)  # type: ignore[assignment]
        by_index = {c.index: c for c in answer.choices}
        if sorted(by_index) != list(range(len(rows))):
            raise EngineAnswerError(f"engine answered choices {sorted(by_index)[:8]}, expected 0..{len(rows) - 1}")
        parts = [row_topk(by_index[b], row, k, vocab) for b, row in enumerate(rows)]
        ids = torch.from_numpy(np.stack([p[0] for p in parts]))
        logp = torch.from_numpy(renormalised(np.stack([p[1] for p in parts]), temperature))
        return KDTargets(kind="topk", ids=ids, logp=logp, vocab=vocab, temperature=float(temperature))

    def answer(self, task: TeacherTask) -> str:
        """Compute and store the targets of one round; 'duplicate' when its key is already answered (SET NX: the
        blob is written, never read back, as a worker's broker user allows: coordinator.broker_acl)."""
        key = target_key(task.run, task.rank, task.recipe, task.key)
        if self.store.exists(key):  # a redelivered round: no engine time (EXISTS is allowed; GET is not)
            return "duplicate"
        if task.kind != "topk":
            raise TeacherRefused(f"an engine teacher answers topk rounds only (the engine gives the k most probable "
                                 f"ids, not samples): round of {task.run} step {task.step} is {task.kind}")
        if task.student_tokenizer is None or task.teacher_vocab is None:
            raise TeacherRefused(f"round of {task.run} step {task.step} carries no student tokenizer or teacher "
                                 "vocabulary: sent by a trainer older than engine teachers")
        self.check_teacher(task)
        self.check_tokenizer(task.student_tokenizer)
        ids = np.frombuffer(task.ids_raw(), dtype="<u4").astype(np.int64).reshape(task.batch, task.seq_len)
        if int(ids.max()) >= task.teacher_vocab:
            raise ValueError(f"token id {int(ids.max())} outside the teacher's vocabulary of {task.teacher_vocab}")
        t0 = time.perf_counter()
        blob = encode(self.targets(ids.tolist(), task.k, task.temperature, task.teacher_vocab))
        self.last_tokens_per_s = ids.size / (time.perf_counter() - t0)
        written = self.store.set(key, blob, nx=True, ex=TARGET_TTL_S)
        self.last_bytes = len(blob) if written else 0
        return "done" if written else "duplicate"
