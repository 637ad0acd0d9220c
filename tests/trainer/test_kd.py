"""KD estimators and the target wire format (issue 36): closed forms, unbiasedness on a toy, intake refusals."""

from __future__ import annotations

import pytest
import torch

from support.models import tiny_llama_dir
from trainer.kd.estimators import full_ce, full_kl, kd_loss, sparse_ce
from trainer.kd.targets import make_targets, target_seed
from wire.kd_targets import KDTargets, TargetFormatError, decode, encode


def _toy(seed: int = 0, b: int = 2, t: int = 3, v: int = 7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, v, generator=g, dtype=torch.float64), torch.randn(b, t, v, generator=g) * 2


def test_full_kl_closed_form_and_zero_at_teacher():
    s, z = _toy()
    p, q = torch.softmax(z.double(), -1), torch.softmax(s, -1)
    ref = (p * (p.log() - q.log())).sum(-1).mean()
    assert full_kl(s, z).item() == pytest.approx(ref.item(), rel=1e-6)
    assert full_kl(z, z).item() == pytest.approx(0.0, abs=1e-6)
    h = -(p * p.log()).sum(-1).mean()
    assert full_ce(s, z).item() == pytest.approx((ref + h).item(), rel=1e-6)


def test_sampled_mean_matches_full_ce_loss_and_kl_gradient():
    """Mean over 4,000 draws of S = 4 ids: value within 1% of full CE, gradient within 0.02 (max abs) of
    full_kl's (the standard error of the mean at 16,000 ids per position is ~0.005 here)."""
    s, z = _toy()
    s = s.float().requires_grad_(True)
    tau = 2.0
    full_ce(s, z, tau).backward()
    g_full, v_full = s.grad.clone(), full_ce(s, z, tau).item()
    s.grad = None
    full_kl(s, z, tau).backward()
    assert torch.allclose(s.grad, g_full, atol=1e-6)  # CE and KL differ by a constant in s
    s.grad = None
    draws = 4000
    vals = []
    for i in range(draws):
        tg = make_targets(z, kind="sampled", k=4, temperature=tau, seed=7, step=i, rank=0)
        loss = sparse_ce(s, tg) / draws
        loss.backward()
        vals.append(loss.item() * draws)
    assert sum(vals) / draws == pytest.approx(v_full, rel=0.01)
    assert (s.grad - g_full).abs().max().item() < 0.02


def test_topk_renormalised_equals_full_when_k_is_vocab_and_is_biased_below():
    s, z = _toy()
    v = z.shape[-1]
    tg = make_targets(z, kind="topk", k=v, temperature=1.0, seed=0, step=0, rank=0)
    assert sparse_ce(s, tg).item() == pytest.approx(full_ce(s, z).item(), rel=1e-5)
    tg3 = make_targets(z, kind="topk", k=3, temperature=1.0, seed=0, step=0, rank=0)
    p = torch.softmax(z.reshape(-1, v), -1)
    top, idx = p.topk(3, -1)
    w = top / top.sum(-1, keepdim=True)
    ref = -(w * torch.log_softmax(s.reshape(-1, v).float(), -1).gather(-1, idx)).sum(-1).mean()
    assert sparse_ce(s, tg3).item() == pytest.approx(ref.item(), rel=1e-5)


def test_kd_loss_mix_and_ce_fallback():
    ce, kd = torch.tensor(3.0), torch.tensor(1.0)
    assert kd_loss(ce, kd, 0.5).item() == 2.0
    assert kd_loss(ce, None, 0.5).item() == 3.0


def test_seeded_targets_are_a_pure_function_of_seed_step_rank():
    _, z = _toy(b=4, t=8, v=50)
    a = make_targets(z, kind="sampled", k=16, temperature=1.0, seed=3, step=5, rank=1)
    b = make_targets(z, kind="sampled", k=16, temperature=1.0, seed=3, step=5, rank=1)
    c = make_targets(z, kind="sampled", k=16, temperature=1.0, seed=3, step=5, rank=2)
    assert torch.equal(a.ids, b.ids) and not torch.equal(a.ids, c.ids)
    assert target_seed(3, 5, 1) != target_seed(3, 1, 5)


def test_wire_round_trip_bit_exact_and_size():
    _, z = _toy(b=2, t=4, v=300)
    tg = make_targets(z, kind="sampled", k=16, temperature=1.0, seed=1, step=0, rank=0)
    blob = encode(tg)
    back = decode(blob, batch_shape=(2, 4), vocab=300)
    assert torch.equal(back.ids, tg.ids) and back.kind == "sampled" and back.temperature == 1.0
    assert torch.equal(back.logp, tg.logp.half().float())
    assert len(blob) - 2 * 4 * 16 * 4 < 400  # uint16 ids + fp16 logp, plus the header
    assert all(encode(tg) == blob for _ in range(20))  # one byte string (safetensors' metadata order is random)
    big = encode(KDTargets("topk", torch.tensor([[[70_000]]]), torch.tensor([[[-0.5]]]), 80_000, 1.0))
    assert decode(big, batch_shape=(1, 1), vocab=80_000).ids.item() == 70_000


@pytest.mark.parametrize("bad, match", [
    (dict(ids=torch.tensor([[[300]]])), "out of range"),
    (dict(logp=torch.tensor([[[float("nan")]]])), "NaN"),
    (dict(logp=torch.tensor([[[0.5]]])), "not a log-probability"),
])
def test_intake_rejects_bad_targets(bad, match):
    fields = dict(kind="topk", ids=torch.tensor([[[3]]]), logp=torch.tensor([[[-1.0]]]), vocab=300,
                  temperature=1.0) | bad
    with pytest.raises(TargetFormatError, match=match):
        decode(encode(KDTargets(**fields), logp_dtype=torch.float32), batch_shape=(1, 1), vocab=300)


def test_intake_rejects_shape_vocab_and_garbage():
    tg = KDTargets("topk", torch.zeros(1, 2, 3, dtype=torch.int64), torch.full((1, 2, 3), -1.0), 300, 1.0)
    with pytest.raises(TargetFormatError, match="shape"):
        decode(encode(tg), batch_shape=(1, 3), vocab=300)
    with pytest.raises(TargetFormatError, match="vocab"):
        decode(encode(tg), batch_shape=(1, 2), vocab=301)
    with pytest.raises(TargetFormatError):
        decode(b"\x00" * 5, batch_shape=(1, 2), vocab=300)


def test_kd_loss_fn_mixes_ce_and_the_estimator_with_seeded_targets(tmp_path):
    """KDLoss on two tiny Llamas equals (1 - a) CE + a sparse_ce of make_targets(seed, batch_key, rank), by hand."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from trainer.kd.teacher import KDLoss, batch_key, load_teacher

    student = AutoModelForCausalLM.from_pretrained(tiny_llama_dir(tmp_path / "s", 400, 0))
    teacher = load_teacher(str(tiny_llama_dir(tmp_path / "t", 400, 1)), "cpu")
    x = torch.randint(0, 400, (2, 8), generator=torch.Generator().manual_seed(0))
    y = torch.roll(x, -1, 1)
    loss_fn = KDLoss(teacher, alpha=0.3, estimator="sampled", k=4, temperature=2.0, seed=5, rank=1)
    got = loss_fn(student, (x, y))
    logits = student(input_ids=x).logits
    with torch.no_grad():
        tg = make_targets(teacher(input_ids=x).logits, kind="sampled", k=4, temperature=2.0, seed=5,
                          step=batch_key(x), rank=1)
    ref = 0.7 * F.cross_entropy(logits.reshape(-1, 400), y.reshape(-1)) + 0.3 * sparse_ce(logits, tg)
    assert got.item() == pytest.approx(ref.item(), rel=1e-6) and loss_fn.calls == 1
    assert loss_fn(student, (x, y)).item() == got.item()  # the same batch (a ZO +/- pair): the same targets


def test_a_teacher_with_another_tokenizer_is_refused_before_the_run_starts(tmp_path):
    """gpt2-tiny (tiktoken GPT-2) taught by a folder with its own 400-id tokenizer: refused naming both, before
    the run folder exists; a folder without weights is refused naming the folder."""
    from support.user_data import hf_tokenizer_dir
    from trainer.config import TrainConfig
    from trainer.kd.teacher import TeacherMismatchError
    from trainer.train import train

    other = tiny_llama_dir(hf_tokenizer_dir(tmp_path / "other", vocab_size=400), 400, 2)
    cfg = TrainConfig(teacher=str(other), steps=3, warmup_steps=0, run_dir=tmp_path / "run")
    with pytest.raises(TeacherMismatchError, match=r"vocab 400\) differs from the student's .*vocab 50257"):
        train(cfg, progress=False)
    assert not (tmp_path / "run").exists()
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(TeacherMismatchError, match="holds no weights"):
        train(cfg.model_copy(update={"teacher": str(tmp_path / "empty")}), progress=False)


def test_kd_fields_only_in_run_json_with_a_teacher():
    from trainer.config import TrainConfig

    assert not {"teacher", "kd_alpha", "kd_k"} & set(TrainConfig().run_json())
    assert TrainConfig(teacher="smollm2-135m").run_json()["kd_estimator"] == "sampled"


def test_intake_counts_rejections_and_falls_back_to_ce():
    from trainer.kd.intake import accept
    from trainer.metrics import KD_REJECTED

    good = encode(KDTargets("sampled", torch.tensor([[[3, 4]]]), torch.tensor([[[-1.0, -2.0]]]), 300, 1.0))
    bad = encode(KDTargets("sampled", torch.tensor([[[3, 300]]]), torch.tensor([[[-1.0, -2.0]]]), 300, 1.0))
    before = KD_REJECTED.labels("kd-test")._value.get()
    tg, why = accept(good, batch_shape=(1, 1), vocab=300, run="kd-test")
    assert tg is not None and why == ""
    tg, why = accept(bad, batch_shape=(1, 1), vocab=300, run="kd-test")
    assert tg is None and "out of range" in why
    assert KD_REJECTED.labels("kd-test")._value.get() == before + 1
    ce = torch.tensor(2.5)
    assert kd_loss(ce, None, 0.5) is ce


def test_an_exported_gpt2_teacher_teaches_a_gpt2_preset_and_a_reencoding_one_is_refused(tmp_path):
    """A gpt2-tiny student's tokenizer is tiktoken's GPT-2 (the preset); a teacher exported by trainer.export carries
    the same BPE as tokenizer.json: other files, the same ids for every probe text, so it is accepted. The same
    tokenizer.json without its first 5,000 merges (same vocabulary and end-of-text id, other ids) is refused."""
    import json

    from trainer.export import export_model, gpt2_tokenizer
    from trainer.kd.teacher import TOKENIZER_PROBE_TEXTS, TeacherMismatchError, check_tokenizers
    from trainer.models import build_model

    teacher = export_model(build_model("gpt2-tiny", seed=3), tmp_path / "teacher", tokenizer=gpt2_tokenizer())
    check_tokenizers("gpt2-tiny", str(teacher))
    spec = json.loads((teacher / "tokenizer.json").read_text())
    spec["model"]["merges"] = spec["model"]["merges"][5000:]
    (teacher / "tokenizer.json").write_text(json.dumps(spec))
    from trainer.data.model_tokenizer import tokenizer_for

    changed = tokenizer_for(str(teacher))
    assert changed.vocab_size == 50257 and changed.eos_id == 50256  # only the encoding differs
    assert changed.encode_batch(list(TOKENIZER_PROBE_TEXTS)) != tokenizer_for("gpt2-tiny").encode_batch(
        list(TOKENIZER_PROBE_TEXTS))
    with pytest.raises(TeacherMismatchError, match="differs from the student's gpt2"):
        check_tokenizers("gpt2-tiny", str(teacher))


def test_a_teacher_run_with_fleet_probes_needs_a_method_that_does_not_update_from_them(tmp_path):
    """Fleet workers evaluate CE: a pure-ZO run (its update is made of their probes) cannot distil and is refused;
    a ZO-Curv run on the fleet and any in-process run may. A teacher folder without tokenizer files is refused as a
    TeacherMismatchError naming --teacher."""
    from support.user_data import hf_tokenizer_dir
    from trainer.config import TrainConfig
    from trainer.kd.teacher import TeacherMismatchError, check_teacher_run

    folder = tiny_llama_dir(hf_tokenizer_dir(tmp_path / "t", vocab_size=400), 400, 2)
    student = str(folder)  # a student of the same folder: one tokenizer
    with pytest.raises(TeacherMismatchError, match="mezo is pure-zo"):
        check_teacher_run(TrainConfig(model=student, teacher=student, optimizer="mezo"), fleet=True)
    check_teacher_run(TrainConfig(model=student, teacher=student, optimizer="mezo"), fleet=False)
    check_teacher_run(TrainConfig(model=student, teacher=student, optimizer="zocurv-line"), fleet=True)
    bare = tiny_llama_dir(tmp_path / "bare", 400, 2)
    with pytest.raises(TeacherMismatchError, match="--teacher: .*no tokenizer files"):
        check_teacher_run(TrainConfig(model=student, teacher=str(bare)), fleet=False)
