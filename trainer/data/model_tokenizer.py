"""The tokenizer of a `--model`: tiktoken GPT-2 for a preset name, the folder's own tokenizer for a
transformers model folder. One interface (`ModelTokenizer`) for the packer (trainer.data.user), the model
builder and the distillation teacher.

Nothing is downloaded from a model hub: a folder's tokenizer is read with `local_files_only=True`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The files a transformers tokenizer may be defined by (tokenizers' tokenizer.json; slow BPE vocab/merges;
# SentencePiece models; WordPiece vocab; the configs naming special tokens and the chat template).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)
# Without one of these there is no vocabulary to load (the configs alone name special tokens only).
_VOCAB_FILES = frozenset({"tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model",
                          "sentencepiece.bpe.model"})


class TokenizerError(ValueError):
    """A model has no usable tokenizer (no tokenizer files, no end-of-text token, unloadable files).

    The message is one line naming the folder or file."""


@dataclass(frozen=True, eq=False)
class ModelTokenizer:
    """A loaded tokenizer.

    Attributes:
        name: "gpt2" for the presets' tiktoken GPT-2; for a folder, "<class name>:<folder>".
        vocab_size: number of token ids, including added/special tokens (every id is < vocab_size): the
            smallest embedding table the ids fit.
        eos_id: the end-of-text token written after every document.
        sha256: hex sha256 of the tokenizer's definition (GPT-2: the rank file's sha256, the split regex
            and the special tokens; a folder: the name and sha256 of each tokenizer file it holds), so a
            packed corpus is rebuilt when the tokenizer changes.
        threads: encode_batch's worker threads (tiktoken) or None for the tokenizers library's own
            parallelism (rayon, all cores unless TOKENIZERS_PARALLELISM=false).
    """

    name: str
    vocab_size: int
    eos_id: int
    sha256: str
    _encode: Any = field(repr=False)
    threads: int | None = None

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (no special tokens added, no EOS appended): list of B lists of ints,
        each id in [0, vocab_size). Special-token strings inside the text are encoded as plain text.

        Raises:
            TypeError: an element of `texts` is not a str.
        """
        texts = list(texts)
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise TypeError(f"texts[{i}] must be a str, got {type(t).__name__}")
        return self._encode(texts)

    @property
    def dtype(self) -> str:
        """numpy dtype name that holds every id: "uint16" when vocab_size <= 65536, else "uint32"."""
        return token_dtype(self.vocab_size)


def token_dtype(vocab_size: int) -> str:
    """"uint16" when every id in [0, vocab_size) fits 16 bits (vocab_size <= 65536), else "uint32".

    Raises:
        ValueError: vocab_size < 1 or above 2**32."""
    if not 1 <= vocab_size <= 2**32:
        raise ValueError(f"vocab_size must be in [1, 2**32], got {vocab_size}")
    return "uint16" if vocab_size <= 2**16 else "uint32"


def _gpt2() -> ModelTokenizer:
    import os

    from trainer.data.tokenizer import EOT, GPT2_PATTERN, N_VOCAB, RANKS_SHA256, gpt2_encoding

    definition = json.dumps({"ranks_sha256": RANKS_SHA256, "pattern": GPT2_PATTERN,
                             "special": {"<|endoftext|>": EOT}, "n_vocab": N_VOCAB}, sort_keys=True)
    threads = max(1, len(os.sched_getaffinity(0)))

    def encode(texts: list[str]) -> list[list[int]]:
        # The rank file is read on first use (a packed corpus checks the hash without it). tiktoken encodes
        # in Rust with the GIL released, one text per thread.
        return gpt2_encoding().encode_ordinary_batch(texts, num_threads=threads)

    return ModelTokenizer(name="gpt2", vocab_size=N_VOCAB, eos_id=EOT,
                          sha256=hashlib.sha256(definition.encode()).hexdigest(), _encode=encode,
                          threads=threads)


def tokenizer_files(folder: Path) -> dict[str, str]:
    """{file name: sha256} of the tokenizer files (TOKENIZER_FILES) present in `folder`."""
    from trainer.data.sources import sha256_file

    return {n: sha256_file(folder / n) for n in TOKENIZER_FILES if (folder / n).is_file()}


def _folder(folder: Path) -> ModelTokenizer:
    files = tokenizer_files(folder)
    if not _VOCAB_FILES & files.keys():
        raise TokenizerError(f"{folder}: no tokenizer files (expected one of {', '.join(sorted(_VOCAB_FILES))}); "
                             "save the model's tokenizer there with tokenizer.save_pretrained(folder)")
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # transformers raises OSError/ValueError/KeyError/... for bad files
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise TokenizerError(f"{folder}: the tokenizer does not load ({type(e).__name__}: {first})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    eos = tok.eos_token_id
    if eos is None:
        raise TokenizerError(f"{folder}: the tokenizer has no end-of-text token (eos_token in "
                             "tokenizer_config.json / special_tokens_map.json) to separate documents")
    vocab_size = len(tok)  # base vocabulary + added tokens
    if tok.is_fast:
        backend = tok.backend_tokenizer  # tokenizers.Tokenizer: encode_batch runs in parallel (rayon)
        backend.encode_special_tokens = True  # "<|endoftext|>" in a text is text, as tiktoken's encode_ordinary

        def encode(texts: list[str]) -> list[list[int]]:
            return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    else:
        def encode(texts: list[str]) -> list[list[int]]:
            return tok(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    definition = json.dumps({"class": type(tok).__name__, "files": files}, sort_keys=True)
    return ModelTokenizer(name=f"{type(tok).__name__}:{folder}", vocab_size=vocab_size, eos_id=int(eos),
                          sha256=hashlib.sha256(definition.encode()).hexdigest(), _encode=encode)


def tokenizer_for(model: str) -> ModelTokenizer:
    """The tokenizer a run on `model` uses.

    Args:
        model: a model preset name (trainer.models.PRESETS: GPT-2 shapes) -> tiktoken GPT-2 BPE
            (vocab 50257, EOS 50256); or a path to a transformers model folder -> its own tokenizer through
            `AutoTokenizer.from_pretrained(folder, local_files_only=True)` (a fast tokenizer's
            `tokenizers` backend when it has one).

    Returns:
        ModelTokenizer with `.encode_batch(texts) -> list[list[int]]`, `.vocab_size`, `.eos_id`, `.name`,
        `.sha256`.

    Raises:
        TokenizerError (a ValueError): `model` is neither a preset nor a folder; the folder has no tokenizer
            files, its tokenizer does not load, or it has no end-of-text token.
        trainer.data.sources.DataFetchError: GPT-2's rank file could not be fetched (presets).
    """
    from trainer.models.presets import PRESETS

    if model in PRESETS:
        return _gpt2()
    path = Path(model).expanduser()
    if path.is_dir():
        return _folder(path.resolve())
    raise TokenizerError(f"--model {model!r} is neither a model preset ({', '.join(PRESETS)}) nor a folder")
