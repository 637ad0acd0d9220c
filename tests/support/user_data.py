"""A user's material for tests, from real text: documents cut from the project's own prose (README.md,
docs/DESIGN.md, split at headings) and a transformers tokenizer folder trained on them with the `tokenizers`
library (byte-level BPE, as GPT-2's), saved with `save_pretrained` as a user's model folder holds it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def real_documents(min_chars: int = 200) -> list[str]:
    """The sections of README.md and docs/DESIGN.md (split before each markdown heading) of at least
    `min_chars` characters, in file order: real English prose and code, ~100 kB in all."""
    docs: list[str] = []
    for name in ("README.md", "docs/DESIGN.md"):
        text = (ROOT / name).read_text(encoding="utf-8")
        docs += [s.strip() for s in re.split(r"\n(?=#{1,4} )", text) if len(s.strip()) >= min_chars]
    return docs


def hf_tokenizer_dir(folder: Path, *, vocab_size: int = 400, texts: list[str] | None = None,
                     eos: str | None = "<|endoftext|>") -> Path:
    """Train a byte-level BPE of `vocab_size` ids on `texts` (default: real_documents()) and save it into
    `folder` as a transformers fast tokenizer (tokenizer.json + tokenizer_config.json). `eos=None` saves one
    without an end-of-text token. Returns `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos] if eos else [],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts if texts is not None else real_documents(), trainer)
    kwargs = {"eos_token": eos} if eos else {}
    PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs).save_pretrained(folder)
    return folder
