"""What the engine-teacher tests share (tests/probe_worker/test_engine_teacher*.py): the k a session engine serves
as started, and real English rows in a model folder's tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

K = 16  # below vLLM's default --max-logprobs (20): the session engine serves it as started


def real_rows(folder: Path, b: int, t: int) -> torch.Tensor:
    """(b, t) int64 ids of real English text (support.user_data.real_documents) in `folder`'s tokenizer."""
    from support.user_data import real_documents
    from trainer.data.model_tokenizer import tokenizer_for

    ids = tokenizer_for(str(folder)).encode_batch(["\n\n".join(real_documents())])[0]
    return torch.tensor(ids[100 : 100 + b * t]).reshape(b, t)
