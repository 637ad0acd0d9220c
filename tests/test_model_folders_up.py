"""`sparecycles up --model DIR --data DIR`: a user's Llama folder (AutoConfig-saved, no weights) and a user's folder
of .txt files; `up` trains both runs (AdamW and the fleet-probed zocurv-line, its rounds on a real worker process
that builds LlamaForCausalLM from the published manifest) and the exported folders load with
AutoModelForCausalLM.from_pretrained. (The Llama fleet's bit-for-bit parity with the in-process run:
tests/test_model_folders.py.)

The model and data are tiny (2 layers, width 32, a 400-id BPE trained on the repository's own prose), so each run
takes seconds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from support.user_data import hf_tokenizer_dir, real_documents, write_formats

pytestmark = pytest.mark.slow  # all of `up`: Valkey, a coordinator, a worker, two 6-step runs

VOCAB = 400


def tiny_llama(folder: Path) -> Path:
    """A user's model folder: LlamaConfig(...).save_pretrained + a 400-id tokenizer, no weights."""
    from transformers import LlamaConfig

    hf_tokenizer_dir(folder, vocab_size=VOCAB)
    LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def user_files(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("user")
    return tiny_llama(root / "my-llama"), write_formats(root / "in", real_documents())["txt"]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(900)
def test_up_model_dir_data_dir_trains_both_runs_and_the_exports_load(user_files, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sparecycles.up_plan import plan_up
    from support.processes import processes_of, start_up

    model, data = user_files
    run_dir = tmp_path / "up"
    proc = start_up(run_dir, "--model", str(model), "--data", str(data), "--workers", "1", "--steps", "6",
                    "--set", "batch_size=4", "--set", "seq_len=32", "--set", "eval_every=3",
                    "--set", "eval_batches=2", "--set", "warmup_steps=1", "--set", "probe_batch_size=2",
                    "--set", "curvature_interval=2", "--fleet-wait", "sync")
    out, _ = proc.communicate(timeout=800)
    assert proc.returncode == 0, out.decode()[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["model"] == "my-llama" and summary["corpus"] == str(data)
    assert summary["workers"] == 1 and summary["steps"] == 6
    assert summary["fleet"]["tasks_published"] >= 1  # the ZO-Curv rounds of the Llama reached the worker
    assert summary["fleet"]["results_accepted"] > 0 and summary["fleet"]["results_invalid"] == 0  # and came back
    assert processes_of(run_dir) == []
    for name in ("adamw", summary["optimizer"]):
        recs = _records(run_dir / name)
        assert [r["step"] for r in recs if "loss" in r] == list(range(1, 7))
        vals = [r["val_loss"] for r in recs if "val_loss" in r]
        assert summary[name]["final_val_loss"] == pytest.approx(vals[-1])
        export = run_dir / name / "export"
        lm = AutoModelForCausalLM.from_pretrained(export)
        tok = AutoTokenizer.from_pretrained(export)
        assert type(lm).__name__ == "LlamaForCausalLM" and len(tok) == VOCAB
        x = torch.tensor([tok("the coordinator publishes a version")["input_ids"]])
        with torch.no_grad():
            loss = lm(x, labels=x).loss.item()
        assert math.isfinite(loss) and loss < math.log(VOCAB) + 0.5
    adamw = [r["val_loss"] for r in _records(run_dir / "adamw") if "val_loss" in r]
    assert adamw[-1] < adamw[0]  # the baseline learned from the user's text
    # without --run-dir, the folder is named by the model folder's name, apart from the demo's
    plan = plan_up(settings={"model": str(model), "data": str(data)})
    assert plan.out.name == "up-demo-zocurv-line-my-llama"
