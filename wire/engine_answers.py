"""A serving engine's answers that an engine-backed teacher reads: vLLM's OpenAI-compatible
`POST /v1/completions` with `prompt_logprobs=k`, `logprobs=k`, `return_tokens_as_token_ids` and `POST /tokenize`.

Strict pydantic models of only the fields read (the engine adds others, ignored); torch-free. A completion's
choice holds, for a prompt of T token ids:

- `prompt_logprobs`: T entries; the first is null (no context), entry t >= 1 maps "<token id>" to
  {logprob, rank} for the k most probable ids at position t (given ids[:t]) and, when not among them, the
  prompt's own id ids[t] (k + 1 entries; its rank > k);
- `logprobs.top_logprobs[0]`: the first generated token's distribution (given all T ids) as
  {"token_id:<id>": logprob}, k entries, or k + 1 when the sampled id is not among them.

The log-probabilities are the model's raw ones (vLLM's default `--logprobs-mode raw_logprobs`: log_softmax of
the logits at temperature 1, before any sampling parameter), in nats; an id of probability 0 comes back as
-9999.0 (vLLM clamps -inf). Parsing checks types only; the teacher checks values (probe_worker.engine_teacher).
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from wire.bounds import MAX_KD_K

MAX_ENGINE_K = MAX_KD_K  # ids per position (wire.bounds)
TOKEN_ID_KEY = re.compile(r"^(?:token_id:)?([0-9]{1,10})$")  # "123" (prompt_logprobs) or "token_id:123"


class EngineModel(BaseModel):
    """Base of the engine's answers: strict types, unknown fields ignored (the engine's own additions)."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


class PromptLogprob(EngineModel):
    """One id's entry at one prompt position: its log-probability (nats, may be non-finite: checked later)."""

    logprob: float
    rank: int | None = None


class CompletionLogprobs(EngineModel):
    """The generated tokens' log-probabilities: ids as "token_id:<id>" (return_tokens_as_token_ids)."""

    tokens: list[str]
    top_logprobs: list[dict[str, float] | None] | None = None


class CompletionChoice(EngineModel):
    """One prompt's answer (`index` is its place in the request's prompt list)."""

    index: Annotated[int, Field(ge=0)]
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    logprobs: CompletionLogprobs | None = None


class CompletionAnswer(EngineModel):
    """`POST /v1/completions`'s answer: one choice per prompt."""

    choices: list[CompletionChoice]


class TokenizeAnswer(EngineModel):
    """`POST /tokenize`'s answer: the ids of the text."""

    tokens: list[int]


class ModelCard(EngineModel):
    """One served model of `GET /v1/models`: its name (`id`) and, for vLLM, the folder it was loaded from."""

    id: str
    root: str | None = None


class ModelList(EngineModel):
    """`GET /v1/models`'s answer."""

    data: Annotated[list[ModelCard], Field(min_length=1)]


def token_id(key: str) -> int:
    """The id of a logprobs key ("123" or "token_id:123"). Raises ValueError for any other text."""
    m = TOKEN_ID_KEY.match(key)
    if m is None:
        raise ValueError(f"engine logprobs key {key[:40]!r} is not a token id (expected 'token_id:N' or 'N')")
    return int(m.group(1))
