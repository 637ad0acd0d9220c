"""Length-bucketed forwards (experiments.zo_paper.length_buckets): the optimal split on known lengths, and bucketed
loss / accuracy equal to one padded forward on a tiny random Llama prompt classifier."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from experiments.zo_paper.length_buckets import bucket_batch, bucketed_ce, length_buckets, padded_tokens
from trainer.prompt_classifier import PromptClassifier


def test_known_lengths_merge_the_cheapest_neighbours():
    """Five groups of 64 rows (lengths 5, 6, 20, 40, 60), at most 4 chunks of >= 64 rows: merging 5 and 6
    pads 64 rows by one token, every other merge costs more, so the optimum is 64·(6+6+20+40+60) = 8,448
    tokens against 320·60 = 19,200 in one chunk."""
    lens = [60] * 64 + [5] * 64 + [40] * 64 + [6] * 64 + [20] * 64  # unsorted on purpose
    ch = length_buckets(lens, max_chunks=4, min_rows=64)
    assert [t for _, t in ch] == [6, 20, 40, 60]
    assert [r.numel() for r, _ in ch] == [128, 64, 64, 64]
    assert sorted(torch.cat([r for r, _ in ch]).tolist()) == list(range(320))
    assert all(int(torch.tensor(lens)[r].max()) == t for r, t in ch)
    assert padded_tokens(lens) == {"real": 64 * 131, "one_chunk": 19200, "bucketed": 8448, "chunks": 4}
    # min_rows binds: chunks of >= 100 rows (at most 3). The top chunk holds the 64 rows of 60 and 36 more (exactly
    # 100 is cheapest), the middle one the 40s and the rest down to 100 rows, the bottom the 120 shortest (max 6)
    assert padded_tokens(lens, 4, 100)["bucketed"] == 120 * 6 + 100 * 40 + 100 * 60
    assert [r.numel() for r, _ in length_buckets(lens, 4, 100)] == [120, 100, 100]
    # one chunk when the batch is small (AdamW's 16) or equal lengths (no gain: fewest chunks on ties)
    assert len(length_buckets([3, 9, 1] * 5, 4, 64)) == 1
    assert len(length_buckets([7] * 300, 4, 64)) == 1
    with pytest.raises(ValueError):
        length_buckets([3, 0, 2])
    with pytest.raises(ValueError):
        length_buckets([], 4, 64)


def test_dynamic_program_matches_brute_force_and_is_deterministic():
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        lens = torch.randint(1, 30, (11,), generator=g)
        srt = sorted(lens.tolist())
        best = min(
            sum((b - a) * srt[b - 1] for a, b in zip((0, *cuts), (*cuts, 11)))
            for k in range(3)
            for cuts in itertools.combinations(range(2, 10), k)
            if all(b - a >= 2 for a, b in zip((0, *cuts), (*cuts, 11)))
        )
        assert padded_tokens(lens, max_chunks=3, min_rows=2)["bucketed"] == best
        a, b = length_buckets(lens, 3, 2), length_buckets(lens.clone(), 3, 2)
        assert all(torch.equal(x[0], y[0]) and x[1] == y[1] for x, y in zip(a, b))


def _tiny_prompt_classifier() -> PromptClassifier:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=True)
    return PromptClassifier(LlamaForCausalLM(cfg).eval(), [3, 7])


def _right_padded(n: int, t: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, t + 1, (n,), generator=g)
    lens[0] = t  # one row fills the width
    mask = (torch.arange(t)[None, :] < lens[:, None]).long()
    ids = torch.randint(0, 40, (n, t), generator=g) * mask
    return ids, mask, torch.randint(0, 2, (n,), generator=g)


@torch.no_grad()
def test_bucketed_loss_and_accuracy_equal_one_padded_forward():
    model = _tiny_prompt_classifier()
    ids, mask, labels = _right_padded(300, 24, seed=5)
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    ref_loss = torch.nn.functional.cross_entropy(logits, labels)
    ref_right = int((logits.argmax(-1) == labels).sum())
    buckets = bucket_batch(ids, mask, labels, max_chunks=4, min_rows=32)
    assert len(buckets) > 1 and sum(b[0].numel() for b in buckets) < ids.numel()
    assert sum(b[2].numel() for b in buckets) == 300
    loss, right = bucketed_ce(model, buckets)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    assert int(right) == ref_right
    # the paper harness's loss: same mean, train accuracy over all rows
    from experiments.zo_paper.paper import AccuracyLoss

    acc = AccuracyLoss()
    assert float(acc(model, buckets)) == pytest.approx(float(ref_loss), rel=1e-5)
    assert acc.first_acc == ref_right / 300
    assert float(AccuracyLoss()(model, (ids, mask, labels))) == pytest.approx(float(ref_loss), rel=1e-6)


def test_paper_batches_keep_the_drawn_rows_and_the_eval_covers_every_row():
    from experiments.zo_paper.paper import PaperData
    from experiments.zo_paper.steps import batch_rows

    splits = {s: _right_padded(n, 20, seed=i) for i, (s, n) in enumerate((("train", 200), ("val", 90),
                                                                          ("test", 130)))}
    # make each training row identifiable: token 0 = row index mod 40, label = row parity
    ids, mask, _ = splits["train"]
    ids[:, 0] = torch.arange(200) % 40
    splits["train"] = (ids, mask, torch.arange(200) % 2)
    data = PaperData(splits, max_chunks=4, min_rows=16)
    rows = batch_rows(0, 3, 200, 128)
    b = data.batch(0, 3, 128)
    assert len(b) > 1
    got = torch.cat([c[0][:, 0] * 1000 + c[1].sum(1) for c in b]).sort().values
    want = (ids[rows, 0] * 1000 + mask[rows].sum(1)).sort().values
    assert torch.equal(got, want)  # the same multiset of (row id, length): sorting changed only the order
    assert torch.cat([c[2] for c in b]).sum() == splits["train"][2][rows].sum()
    one = data.batch(0, 3, 128, max_chunks=1)  # A2's setting: one batch padded to its longest drawn row
    assert len(one) == 1 and one[0][0].shape == (128, int(mask[rows].sum(1).max()))
    assert torch.equal((one[0][0][:, 0] * 1000 + one[0][1].sum(1)).sort().values, want)
    model = _tiny_prompt_classifier()
    with torch.no_grad():
        v_ids, v_mask, v_lab = splits["val"]
        ref = int((model(input_ids=v_ids, attention_mask=v_mask).logits.argmax(-1) == v_lab).sum()) / 90
    assert data.accuracy(model, "val") == ref


def test_padding_report_counts_the_tokens_of_the_paper_batches():
    from experiments.zo_paper.paper import PaperData, padding_report

    splits = {s: _right_padded(n, 20, seed=i) for i, (s, n) in enumerate((("train", 200), ("val", 20),
                                                                          ("test", 20)))}
    r = padding_report(PaperData(splits, max_chunks=4, min_rows=16), iterations=3, batch_size=128)
    t = r["tokens_per_batch"]
    assert t["real"] <= t["bucketed"] < t["one_chunk"] and r["train_max_len"] == 20
    assert r["speedup_tokens"] == pytest.approx(t["one_chunk"] / t["bucketed"])
