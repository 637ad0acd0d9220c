"""`--model DIR`: transformers folders (config.json + tokenizer files, optional safetensors weights).

Tiny Llama / Qwen3 / Gemma 3 folders are written as a user would (`LlamaConfig(...).save_pretrained`, a byte-level
BPE trained on the repository's own prose: tests.support.user_data.hf_tokenizer_dir), so every test takes seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.user_data import hf_tokenizer_dir, real_documents, write_formats
from trainer.models.causal_lm import build_causal_lm, build_from_manifest, check_model_spec, check_roles
from trainer.models.gpt2 import param_seed
from trainer.models.params import param_order_hash

VOCAB = 400
DOCS = real_documents()


def llama_dir(folder: Path, *, vocab_size: int = VOCAB, context: int = 128, tokenizer: bool = True) -> Path:
    """An AutoConfig-saved tiny Llama folder (no weights) with a 400-id tokenizer."""
    from transformers import LlamaConfig

    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer:
        hf_tokenizer_dir(folder, vocab_size=VOCAB)
    LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                tie_word_embeddings=True).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return llama_dir(tmp_path_factory.mktemp("llama") / "tiny-llama")


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sparecycles.cli", *args], capture_output=True, text=True,
                          timeout=600, env=env)


def test_folder_without_weights_gets_the_seeded_counter_based_init(llama):
    rng = torch.get_rng_state()
    model, info = build_causal_lm(str(llama), seed=7)
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is untouched
    assert (info.model_class, info.vocab_size, info.context, info.weights_loaded) == ("LlamaForCausalLM", VOCAB,
                                                                                      128, False)
    assert info.label == "tiny-llama" and info.tokenizer.vocab_size == VOCAB
    params = dict(model.named_parameters())
    name = "model.layers.1.self_attn.q_proj.weight"
    gen = torch.Generator().manual_seed(param_seed(7, name))
    want = torch.empty(params[name].shape).normal_(0.0, model.config.initializer_range, generator=gen)
    assert torch.equal(params[name], want)  # drawn from its own (seed, name) generator
    assert torch.equal(params["model.norm.weight"], torch.ones(32))  # RMSNorm gain: the class's constant
    again, _ = build_causal_lm(str(llama), seed=7)
    other, _ = build_causal_lm(str(llama), seed=8)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    assert not torch.equal(params[name], dict(other.named_parameters())[name])


def test_folder_with_weights_continues_from_them(llama, tmp_path):
    import shutil

    model, _ = build_causal_lm(str(llama), seed=3)
    folder = tmp_path / "with-weights"
    shutil.copytree(llama, folder)
    model.save_pretrained(folder)
    loaded, info = build_causal_lm(str(folder), seed=99)  # the seed does not matter: the weights are read
    assert info.weights_loaded
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), loaded.parameters()))


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_the_worker_builds_the_same_architecture_from_the_manifest(tmp_path, family):
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen3Config

    from fleet.publisher import manifest_config

    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128)
    config = {"llama": LlamaConfig, "qwen3": Qwen3Config, "gemma3": Gemma3TextConfig}[family](
        **shape, **({"head_dim": 8} if family != "llama" else {}))
    hf_tokenizer_dir(tmp_path, vocab_size=VOCAB)
    config.save_pretrained(tmp_path)
    model, info = build_causal_lm(str(tmp_path), seed=1)
    check_roles(str(tmp_path))  # every parameter has a ZO-Curv block role
    worker = build_from_manifest(info.model_class, manifest_config(model), device="cpu")
    assert param_order_hash(worker) == param_order_hash(model)
    worker.load_state_dict(model.state_dict())
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(worker(x).logits, model(x).logits)  # bit for bit


def test_refusals_name_the_folder_and_what_is_wrong(tmp_path, llama):
    from transformers import GPTNeoXConfig, ViTConfig

    no_tok = llama_dir(tmp_path / "no-tok", tokenizer=False)
    with pytest.raises(ValueError, match="no-tok: no tokenizer files"):
        check_model_spec(str(no_tok), 32)
    small = llama_dir(tmp_path / "small-emb", vocab_size=300)
    with pytest.raises(ValueError, match="the tokenizer has 400 tokens but the model's embeddings only 300"):
        check_model_spec(str(small), 32)
    with pytest.raises(ValueError, match=r"--seq-len 129 exceeds .*context of 128 tokens"):
        check_model_spec(str(llama), 129)
    vit = tmp_path / "vit"
    hf_tokenizer_dir(vit, vocab_size=VOCAB)
    ViTConfig().save_pretrained(vit)
    with pytest.raises(ValueError, match="no causal-LM class for model_type 'vit'"):
        check_model_spec(str(vit), 32)
    with pytest.raises(ValueError, match="no config.json"):
        check_model_spec(str(tmp_path), 32)
    neox = tmp_path / "neox"
    hf_tokenizer_dir(neox, vocab_size=VOCAB)
    GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64).save_pretrained(neox)
    check_model_spec(str(neox), 32)  # trainable with AdamW, but ZO-Curv's roles do not know its names:
    with pytest.raises(ValueError, match=r"cannot place parameter 'gpt_neox\.embed_in\.weight'"):
        check_roles(str(neox))


def test_cli_refusals_are_one_line_exit_2_and_write_nothing(tmp_path, llama):
    from transformers import GPTNeoXConfig

    neox = tmp_path / "neox"
    hf_tokenizer_dir(neox, vocab_size=VOCAB)
    GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64).save_pretrained(neox)
    txt = write_formats(tmp_path / "in", DOCS[:20])["txt"]
    cases = [([str(llama), "--seq-len", "256"], "exceeds"),
             ([str(llama_dir(tmp_path / "no-tok", tokenizer=False))], "no tokenizer files"),
             ([str(neox), "--optimizer", "zocurv-group"], "cannot place parameter 'gpt_neox.embed_in.weight'"),
             ([str(llama), "--batch-size", "512", "--seq-len", "128"], "fewer than one batch")]
    for args, words in cases:
        run_dir = tmp_path / "run"
        got = _cli("train", "--model", *args, "--data", str(txt), "--steps", "2", "--run-dir", str(run_dir),
                   "--no-progress")
        lines = [line for line in got.stderr.splitlines() + got.stdout.splitlines() if line.strip()]
        assert got.returncode == 2 and words in got.stderr + got.stdout, (args, got.stdout, got.stderr)
        assert len([line for line in lines if "Error" in line or words in line]) <= 2, lines
        assert not (run_dir / "checkpoint.safetensors").exists() and not (run_dir / "summary.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["txt", "jsonl", "parquet"])
def test_train_model_dir_data_dir_end_to_end_and_the_export_loads(tmp_path, llama, fmt):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = write_formats(tmp_path / "in", DOCS)[fmt]
    run_dir = tmp_path / "run"
    got = _cli("train", "--model", str(llama), "--data", str(data), "--steps", "6", "--batch-size", "4",
               "--seq-len", "32", "--warmup-steps", "0", "--eval-every", "3", "--eval-batches", "2",
               "--run-dir", str(run_dir), "--export", "--no-progress")
    assert got.returncode == 0, got.stdout[-2000:] + got.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["model"] == "tiny-llama" and summary["steps"] == 6
    assert summary["final_val_loss"] < torch.log(torch.tensor(float(VOCAB))).item()  # below uniform: it learned
    export = next(p for p in run_dir.rglob("config.json") if p.parent != run_dir).parent
    model = AutoModelForCausalLM.from_pretrained(export)
    tok = AutoTokenizer.from_pretrained(export)
    assert type(model).__name__ == "LlamaForCausalLM" and len(tok) == VOCAB
    init, _ = build_causal_lm(str(llama), seed=0)
    assert not torch.equal(model.model.embed_tokens.weight, init.model.embed_tokens.weight)  # the trained weights
    x = torch.tensor([tok("the coordinator")["input_ids"]])
    assert torch.isfinite(model(x).logits).all()


@pytest.mark.slow
def test_llama_zocurv_fleet_sync_equals_in_process_bit_for_bit(tmp_path, llama):
    """A Llama-family zocurv-block run through a real coordinator + one real worker process (`--fleet-wait sync`)
    logs exactly the values of its in-process run: losses, curvature, multipliers, accepted results."""
    from fleet.attach import Fleet, FleetStatus
    from support.fleet import one_worker
    from trainer.config import TrainConfig
    from trainer.train import TrainHooks, train

    data = write_formats(tmp_path / "in", DOCS)["txt"]

    def cfg(name: str, optimizer: str) -> TrainConfig:
        return TrainConfig(model=str(llama), data=str(data), optimizer=optimizer, steps=4, batch_size=2, seq_len=16,
                           lr=3e-3, warmup_steps=1, eval_every=4, eval_batches=1, checkpoint_every=100, probes=2,
                           probe_batch_size=1, curvature_interval=2, probe_budget=21, eps=1e-2,
                           run_dir=tmp_path / name)

    def values(run_dir: Path) -> list[tuple[int, str, float]]:
        skip = ("elapsed_s", "probe_wall_s", "publish_s", "publish_unix", "forward_passes", "probe_forwards")
        recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], k, v) for r in recs for k, v in sorted(r.items())
                if k != "step" and k not in skip and not k.startswith("fleet_") and not k.endswith("_duplicate")]

    (tmp_path / "fleet").mkdir()
    with one_worker(tmp_path / "fleet") as (procs, settings):
        for optimizer in ("zocurv-block", "zocurv-group"):
            fleet = Fleet(procs.url, settings, 1, FleetStatus(procs.url), run_prefix="llama", rounds="sync")
            on_fleet = train(cfg(f"fleet-{optimizer}", optimizer), progress=False, export=False,
                             hooks=TrainHooks(mode_factory=fleet.mode_factory))
            local = train(cfg(f"local-{optimizer}", optimizer), progress=False, export=False)
            got, want = values(on_fleet.run_dir), values(local.run_dir)
            assert got == want, optimizer  # floats compared exactly
            accepted = [v for _, k, v in got if k.endswith("_accepted")]
            assert accepted and max(accepted) > 0  # the worker's results were taken


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_up_model_dir_data_dir_trains_both_runs_on_the_fleet_and_exports_them(tmp_path, llama):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from support.processes import processes_of, start_up

    data = write_formats(tmp_path / "in", DOCS)["txt"]
    run_dir = tmp_path / "up"
    proc = start_up(run_dir, "--model", str(llama), "--data", str(data), "--steps", "4", "--curvature-interval", "2",
                    "--batch-size", "4", "--seq-len", "32", "--eval-every", "2", "--eval-batches", "2",
                    "--warmup-steps", "0", "--export")
    out, _ = proc.communicate(timeout=800)
    assert proc.returncode == 0, out.decode()[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["fleet"]["results_accepted"] > 0  # the workers built the Llama from the manifests and probed it
    assert summary["zocurv-line"]["evaluations"]["fleet"] > 0
    for name in ("adamw", "zocurv-line"):
        assert summary[name]["final_val_loss"] < summary[name]["initial_val_loss"]
        model = AutoModelForCausalLM.from_pretrained(run_dir / name / "export")
        assert type(model).__name__ == "LlamaForCausalLM"
        assert len(AutoTokenizer.from_pretrained(run_dir / name / "export")) == VOCAB
    assert processes_of(run_dir) == []
