"""A user's material for tests, from real text: documents cut from the project's own prose (README.md,
pages of docs/, split at headings) and a transformers tokenizer folder trained on them with the `tokenizers`
library (byte-level BPE, as GPT-2's), saved with `save_pretrained` as a user's model folder holds it."""

from __future__ import annotations

import re
from pathlib import Path

from support.paths import ROOT


def real_documents(min_chars: int = 400) -> list[str]:
    """Documents of real English prose and code from README.md and pages of docs/, in file order: runs of
    consecutive paragraphs (split at blank lines) of at least `min_chars` characters; ~100 kB in all."""
    docs: list[str] = []
    for name in ("README.md", "docs/DESIGN.md", "docs/training.md", "docs/models-and-data.md", "docs/distillation.md",
                 "docs/fleet.md"):
        run: list[str] = []
        for para in re.split(r"\n\s*\n", (ROOT / name).read_text(encoding="utf-8")):
            if para.strip():
                run.append(para.strip())
            if sum(map(len, run)) >= min_chars:
                docs.append("\n\n".join(run))
                run = []
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


def write_formats(root: Path, docs: list[str], field: str = "text") -> dict[str, Path]:
    """The same documents, in order, as each input format under `root`: a folder of .txt files (zero-padded
    names keep the order), a .jsonl, a .json array, a .json of JSON lines, a .parquet (two row groups), and
    `datasets` save_to_disk folders (a Dataset; a DatasetDict of two splits). Returns {format: path}."""
    import json

    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    datasets.disable_progress_bars()
    root.mkdir(parents=True, exist_ok=True)
    txt = root / "txt"
    txt.mkdir()
    for i, t in enumerate(docs):
        (txt / f"{i:04d}.txt").write_text(t, encoding="utf-8")
    rows = [{"id": i, field: t} for i, t in enumerate(docs)]
    (root / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (root / "array.json").write_text(json.dumps(rows, indent=1), encoding="utf-8")
    (root / "lines.json").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    pq.write_table(pa.table({"id": list(range(len(docs))), field: docs}), root / "docs.parquet",
                   row_group_size=max(1, len(docs) // 2))
    ds = datasets.Dataset.from_dict({field: docs})
    ds.save_to_disk(str(root / "ds"))
    half = len(docs) // 2
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({field: docs[:half]}),
                          "test": datasets.Dataset.from_dict({field: docs[half:]})}).save_to_disk(str(root / "dsdict"))
    return {"txt": txt, "jsonl": root / "docs.jsonl", "json": root / "array.json", "json-lines": root / "lines.json",
            "parquet": root / "docs.parquet", "datasets": root / "ds", "datasets-dict": root / "dsdict"}


def wide_tokenizer_dir(folder: Path, texts: list[str], vocab_size: int = 70_000) -> Path:
    """A word-level tokenizer (tokenizers' WordLevel) of `vocab_size` ids whose real words sit at the top ids
    (above 65,535), so its token ids need uint32; "<eos>" is id 0, "<unk>" id 1. Saved as a transformers
    folder. Returns `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for t in texts for w in pre_tokenizers.Whitespace().pre_tokenize_str(t) for w in [w[0]]})
    filler = vocab_size - 2 - len(words)
    vocab = {"<eos>": 0, "<unk>": 1, **{f"<filler{i}>": 2 + i for i in range(filler)}}
    vocab.update({w: 2 + filler + i for i, w in enumerate(words)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>").save_pretrained(folder)
    return folder
