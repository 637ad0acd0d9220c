"""`--model DIR` on a fleet: a user's Llama folder (AutoConfig-saved, no weights) trained on a user's folder of
.txt files through a real coordinator and a real probe-worker process.

- Parity: a Llama-family ZO-Curv run attached as `train --coordinator --fleet-sync` attaches it (fleet.attach.Fleet,
  rounds "sync") equals its in-process run bit for bit: the worker builds LlamaForCausalLM from the published
  manifest (model_class + model_config_json, probe_worker.cache.build_from_tensors) and evaluates the same probes.
- `sparecycles up --model DIR --data DIR` trains both runs (AdamW and the fleet-probed one) and the exported
  folders load with AutoModelForCausalLM.from_pretrained.

The model and data are tiny (2 layers, width 32, a 400-id BPE trained on the repository's own prose), so each run
takes seconds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from support.user_data import hf_tokenizer_dir, real_documents, write_formats
from trainer.config import TrainConfig
from trainer.train import train

pytestmark = pytest.mark.slow  # a coordinator and a worker process (or all of `up`), short runs

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


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory):
    from support.fleet import one_worker as fleet_of_one

    with fleet_of_one(tmp_path_factory.mktemp("fleet_llama")) as got:
        yield got


def _cfg(run_dir: Path, model: Path, data: Path, optimizer: str) -> TrainConfig:
    # curvature rounds at steps 0 and 2 (zocurv-line: at 2, along θ_2 − θ_1); probe budget 21 gives zocurv-group
    # 2 probes per role (Llama's roles: embed, qk, vo, ffn, norm, head)
    return TrainConfig(model=str(model), data=str(data), optimizer=optimizer, steps=4, batch_size=2, seq_len=16,
                       lr=3e-3, warmup_steps=1, eval_every=4, eval_batches=1, checkpoint_every=100, probes=2,
                       probe_batch_size=1, curvature_interval=2, probe_budget=21, eps=1e-2, run_dir=run_dir)


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _values(run_dir: Path) -> list[tuple[int, str, float]]:
    """Every logged value that does not measure time or the fleet (as tests/test_fleet_zocurv.py compares)."""
    skip = ("elapsed_s", "probe_wall_s", "publish_s", "publish_unix", "forward_passes", "probe_forwards")
    return [(r["step"], k, v) for r in _records(run_dir) for k, v in sorted(r.items())
            if k != "step" and k not in skip and not k.startswith("fleet_") and not k.endswith("_duplicate")]


@pytest.mark.parametrize("optimizer", ["zocurv-line", "zocurv-group"])
def test_llama_folder_fleet_sync_equals_in_process(one_worker, user_files, tmp_path, optimizer):
    from fleet.attach import Fleet, FleetStatus

    procs, settings = one_worker
    model, data = user_files
    fleet = Fleet(procs.url, settings, 1, FleetStatus(procs.url), run_prefix="ll", rounds="sync")
    on_fleet = train(_cfg(tmp_path / "fleet", model, data, optimizer), progress=False, export=False,
                     mode_factory=fleet.mode_factory)
    local = train(_cfg(tmp_path / "local", model, data, optimizer), progress=False, export=False)
    got, want = _values(on_fleet.run_dir), _values(local.run_dir)
    assert got == want  # floats compared exactly: losses, curvature, multipliers, round counters
    accepted = [v for _, k, v in got if k.endswith("_accepted")]
    assert accepted and max(accepted) > 0  # the worker's results were taken
    assert max(r.get("fleet_results_accepted", 0) for r in _records(on_fleet.run_dir)) > 0
    losses = [v for _, k, v in got if k == "loss"]
    assert len(losses) == 4 and abs(losses[0] - math.log(VOCAB)) < 0.05  # the seeded init: near-uniform logits


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
