"""Transformers exports (trainer.export): a gpt2-tiny run reloads through AutoModelForCausalLM with the run's
validation loss bit for bit, the MiniLM classifier through AutoModelForSequenceClassification with the run's
test accuracy, the GPT-2 tokenizer encodes like the project's tiktoken BPE, SmolLM2's architecture
(a tiny LlamaForCausalLM) round-trips, run folders that cannot be exported are clear errors, and --overwrite replaces
only an earlier export (never a run, a folder of runs, the current folder, home, ...: refused, nothing deleted)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from support.events import metrics_records
from trainer.config import TrainConfig
from trainer.export import (
    ExportError,
    _write_folder,
    export_model,
    export_run,
    gpt2_tokenizer,
    out_dir_refusal,
)
from trainer.train import train


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    """A finished 4-step gpt2-tiny AdamW run with its automatic export."""
    cfg = TrainConfig(model="gpt2-tiny", corpus="classics-small", steps=4, batch_size=4, seq_len=32, lr=3e-3,
                      warmup_steps=1, eval_every=2, eval_batches=2, checkpoint_every=2,
                      run_dir=tmp_path_factory.mktemp("export") / "lm")
    return cfg, train(cfg, progress=False)


def test_gpt2_export_reloads_with_the_runs_validation_loss_bit_for_bit(lm_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from trainer.data import load_corpus
    from trainer.train import evaluate

    cfg, res = lm_run
    out = res.run_dir / "export"
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "sparecycles.json"} <= names
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert type(model).__name__ == "GPT2LMHeadModel" and model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # still tied
    last_eval = [r for r in metrics_records(res.run_dir) if "val_loss" in r][-1]
    assert last_eval["step"] == 4
    # The run's own evaluation (same windows, same loss function) on the reloaded model: identical float.
    assert evaluate(model, load_corpus(cfg.corpus).val, cfg) == last_eval["val_loss"] == res.final_val_loss
    gen = GenerationConfig.from_pretrained(out)
    assert gen.eos_token_id == gen.bos_token_id == 50256
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tok("Hello world")["input_ids"] == [15496, 995] and tok.eos_token_id == 50256
    info = json.loads((out / "sparecycles.json").read_text())
    assert info["step"] == 4 and info["final"]["final_val_loss"] == res.final_val_loss
    # `sparecycles export` of the same folder rebuilds the same weights from checkpoint.safetensors.
    again = export_run(res.run_dir, res.run_dir.parent / "again")
    a, b = load_file(str(out / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_gpt2_tokenizer_encodes_like_the_projects_tiktoken_bpe():
    from trainer.data import load_corpus
    from trainer.data.tokenizer import gpt2_encoding

    enc, tok = gpt2_encoding(), gpt2_tokenizer()
    # 40k validation tokens decoded to text (plays, verse, scripture, <|endoftext|> between documents).
    text = enc.decode(load_corpus("classics-small").val[:40_000].tolist())
    assert "<|endoftext|>" in text
    ids = enc.encode(text, allowed_special="all")
    assert tok(text)["input_ids"] == ids
    assert tok.decode(ids) == text
    odd = "  naïve café 1234567 ''s 'LL\t\n\n  \u00a0end 😀 <|endoftext|>"
    assert tok(odd)["input_ids"] == enc.encode(odd, allowed_special="all")


def test_unexportable_run_folders_are_clear_errors(lm_run, tmp_path):
    _, res = lm_run
    with pytest.raises(ExportError, match="no run folder"):
        export_run(tmp_path / "nope", tmp_path / "o1")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match="config.json"):
        export_run(tmp_path / "empty", tmp_path / "o2")
    no_ckpt = tmp_path / "no_ckpt"
    no_ckpt.mkdir()
    shutil.copy(res.run_dir / "config.json", no_ckpt)
    with pytest.raises(ExportError, match="before its first checkpoint"):
        export_run(no_ckpt, tmp_path / "o3")
    unfinished = tmp_path / "unfinished"  # an interrupted run: a checkpoint but no summary of that step
    shutil.copytree(res.run_dir, unfinished, ignore=shutil.ignore_patterns("summary.json", "export"))
    with pytest.raises(ExportError, match="has not finished.*step 4.*--partial"):
        export_run(unfinished, tmp_path / "o4")
    assert export_run(unfinished, tmp_path / "o4", partial=True).joinpath("model.safetensors").is_file()
    with pytest.raises(FileExistsError, match="overwrite"):
        export_run(res.run_dir, tmp_path / "o4")
    # The CLI: exit 2 and the message, no traceback.
    cli = [sys.executable, "-m", "sparecycles.cli", "export"]
    bad = subprocess.run([*cli, str(no_ckpt), str(tmp_path / "o5")], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "first checkpoint" in bad.stderr and "Traceback" not in bad.stderr


def _files(root):
    """sha256 of every file under `root` by relative path (links not followed): what a refusal must leave alone."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def test_overwrite_refuses_every_folder_that_is_not_an_earlier_export(lm_run, tmp_path, monkeypatch):
    _, res = lm_run
    runs = tmp_path / "runs"  # a folder of runs, as `sparecycles train` leaves runs/
    t1, t2 = runs / "t1", runs / "t2"
    shutil.copytree(res.run_dir, t1)
    shutil.copytree(res.run_dir, t2)
    notes = tmp_path / "notes"  # a user's folder
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me\n")
    nested = tmp_path / "nested"  # an export with a folder in it: more than an export
    shutil.copytree(res.run_dir / "export", nested)
    (nested / "mine").mkdir()
    (nested / "mine" / "a.txt").write_text("mine\n")
    shutil.copytree(res.run_dir / "export", tmp_path / "earlier")
    link = tmp_path / "link"  # to an earlier export: replacing would put a folder where the user's link was
    link.symlink_to(tmp_path / "earlier", target_is_directory=True)
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("# mine\n")
    monkeypatch.setenv("HOME", str(home))
    work = tmp_path / "deep" / "work"  # the current folder, inside one more folder
    shutil.copytree(res.run_dir / "export", work)  # even an export is not replaced while it is the current folder
    monkeypatch.chdir(work)
    before = _files(tmp_path)
    assert len(before) > 20 and "runs/t2/checkpoint.safetensors" in before
    refused = [
        (runs, "OUT_DIR .*/runs holds the run folder .*/t1"),
        (t1, "is the run folder itself"),
        (t2, "not an earlier export \\(it holds a run \\(checkpoint.safetensors, metrics.jsonl\\)\\)"),
        (t1 / "export", "inside the run folder"),
        (notes, "not an earlier export \\(it has no sparecycles.json, config.json, model.safetensors\\)"),
        (nested, "it holds folders \\(mine\\)"),
        (link, "is a link"),
        (home, "root or your home folder"),
        (Path("."), "the current folder or one above it"),
        (tmp_path / "deep", "the current folder or one above it"),
    ]
    for out, why in refused:
        with pytest.raises(FileExistsError, match=why) as got:
            export_run(t1, out, overwrite=True)
        assert "nothing was deleted" in str(got.value) or "run folder itself" in str(got.value)
        assert _files(tmp_path) == before, out
    assert "root" in out_dir_refusal(Path("/"), overwrite=True)
    # Without --overwrite the run folder itself is named as such, not met with a hint to pass --overwrite.
    with pytest.raises(FileExistsError, match="is the run folder itself"):
        export_run(t1, t1)
    # The CLI: exit 2, one line naming the reason, no traceback, nothing deleted.
    cli = [sys.executable, "-m", "sparecycles.cli", "export"]
    for out, why in [(runs, "holds the run folder"), (t1, "is the run folder itself")]:
        bad = subprocess.run([*cli, str(t1), str(out), "--overwrite"], capture_output=True, text=True, timeout=300)
        assert bad.returncode == 2 and why in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        assert _files(tmp_path) == before


def test_overwrite_replaces_an_earlier_export_whole_and_a_failed_one_leaves_it(lm_run, tmp_path):
    _, res = lm_run
    out = tmp_path / "hf"
    export_run(res.run_dir, out)
    (out / "stale.txt").write_text("from the earlier export\n")
    (out / "sparecycles.json").write_text(json.dumps({"step": -1}))
    export_run(res.run_dir, out, overwrite=True)
    assert not (out / "stale.txt").exists() and json.loads((out / "sparecycles.json").read_text())["step"] == 4
    assert load_file(out / "model.safetensors").keys() == load_file(res.run_dir / "export" / "model.safetensors").keys()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no staging folder left beside it
    before = _files(out)

    def fail(tmp):
        (tmp / "config.json").write_text("{}")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        _write_folder(out, fail, overwrite=True)
    assert _files(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_tiny_llama_prompt_classifier_exports_its_lm():
    """SmolLM2's architecture (LlamaForCausalLM, tied embeddings), shrunk to build on CPU in a blink, inside
    the PromptClassifier the ZO sentiment benchmark trains: the export is the LM, logits bit-identical."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from trainer.prompt_classifier import LABEL_WORDS, PromptClassifier, label_token_ids

    tok = gpt2_tokenizer(64)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        lm = LlamaForCausalLM(config).eval()
    clf = PromptClassifier(lm, label_token_ids(tok))
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        out = export_model(clf, f"{d}/llama", tokenizer=tok, info={"note": "tiny"})
        back = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
        assert type(back).__name__ == "LlamaForCausalLM"
        ids = torch.tensor([tok("Review: fine.\nSentiment:")["input_ids"]])
        with torch.no_grad():
            assert torch.equal(back(input_ids=ids).logits, lm(input_ids=ids).logits)
        info = json.loads((out / "sparecycles.json").read_text())
        assert info["prompt_classifier"]["label_words"] == list(LABEL_WORDS) and info["note"] == "tiny"
        assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 50256
        assert AutoTokenizer.from_pretrained(out)("Hi")["input_ids"] == tok("Hi")["input_ids"]
        with pytest.raises(TypeError, match="PreTrainedModel"):
            export_model(torch.nn.Linear(2, 2), f"{d}/linear", tokenizer=tok)


def test_minilm_export_reproduces_the_runs_test_accuracy(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from trainer.data import load_sentiment

    cfg = TrainConfig(task="sentiment", optimizer="adamw", steps=2, batch_size=16, seq_len=32, lr=2e-4,
                      min_lr=2e-5, warmup_steps=0, eval_every=2, eval_batches=2, checkpoint_every=2,
                      run_dir=tmp_path / "sent")
    res = train(cfg, progress=False)
    out = res.run_dir / "export"
    model = AutoModelForSequenceClassification.from_pretrained(out, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert type(model).__name__ == "BertForSequenceClassification" and tok.model_max_length == 32
    assert model.config.id2label == {0: "negative", 1: "positive"}
    test = load_sentiment().test
    right, loss = 0, 0.0
    with torch.no_grad():
        for i in range(0, len(test), 256):  # the run's scoring chunks; padding to the chunk's longest
            rows = test[i:i + 256]
            enc = tok([t for t, _ in rows], padding=True, truncation=True, return_tensors="pt")
            labels = torch.tensor([y for _, y in rows])
            logits = model(**{k: enc[k] for k in ("input_ids", "attention_mask")}).logits
            right += int((logits.argmax(-1) == labels).sum())
            loss += float(torch.nn.functional.cross_entropy(logits, labels, reduction="sum"))
    assert right / len(test) == res.summary["test_acc"]
    assert loss / len(test) == res.summary["test_loss"]
