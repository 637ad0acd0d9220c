"""A Hugging Face `Trainer` on a tiny GPT-2 with the fleet's services (docs/api.md, "Your loop").

    SPARECYCLES_ADMIN_TOKEN=... SPARECYCLES_REDIS_URL=redis://... \\
        python examples/hf_trainer.py --coordinator http://127.0.0.1:8000 --out /tmp/hf-run

Text: the bytes of this repository's README.md (one token per byte, vocabulary 256), split by position into
train (80 %), validation (10 %, the evaluation windows) and selection (10 %, the anytime model's). The optimizer is
ZO-Curv (block multipliers from probe rounds on the fleet's workers); the fleet evaluates the validation windows
every `--eval-every` steps and at the end; the anytime model is chosen at the end and exported as a transformers
folder OUT/anytime. Prints (and writes to OUT/result.json) one JSON object: Trainer's own eval_loss on the same windows, the fleet's records, the
export folder. Without --coordinator everything runs in this process.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]


def byte_splits(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(train, val, select) uint16 token ids: the file's bytes, cut at 80 % and 90 %."""
    tokens = np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.uint16)
    a, b = int(len(tokens) * 0.8), int(len(tokens) * 0.9)
    return tokens[:a], tokens[a:b], tokens[b:]


def tiny_gpt2(seed: int, seq_len: int) -> torch.nn.Module:
    """GPT2LMHeadModel, 2 layers of width 32 over 256 byte tokens, initialised from `seed` (the global RNG is
    left as it was)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=256, n_positions=seq_len, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT2LMHeadModel(config)


def main(coordinator: str | None, out: Path, *, steps: int = 6, eval_every: int = 3, seq_len: int = 32,
         batch_size: int = 4, seed: int = 0) -> dict[str, Any]:
    """Train `steps` steps and return {"trainer_eval_loss", "fleet_records", "served", "export", "curvature_ready",
    "multipliers" (the ZO-Curv block multipliers reached), "rounds" (the round book's counters), "probe_forwards"}."""
    from transformers import Trainer, TrainingArguments

    import sparecycles as sc
    from sparecycles.hf import FleetCallback, lm_compute_loss, windows_dataset

    train_tokens, val_tokens, select_tokens = byte_splits(ROOT / "README.md")
    windows = sc.lm_windows(val_tokens, batch_size, seq_len, max_batches=4)
    train_windows = sc.lm_windows(train_tokens, batch_size, seq_len, max_batches=steps * 2, split="train")
    # rounds="sync": each ZO-Curv round folds at its own refresh (waiting for it), so the run equals the in-process
    # one bit for bit; "async" (connect's default) never waits and folds what has arrived.
    fleet = sc.connect(coordinator, wait_s=120.0, rounds="sync") if coordinator else None
    model = tiny_gpt2(seed, seq_len)
    callback = FleetCallback(windows, fleet=fleet, eval_every=eval_every, anytime_tokens=select_tokens,
                             anytime={"k": 3, "publish_every": 1, "select_batches": 2, "windows": (2,),
                                      "half_lives": (1.0,), "quad_dim": 0},
                             run_dir=out)
    optimizer = callback.zocurv(model, lr=1e-3, curvature_interval=2, probes=4, probe_batch_size=2, seed=seed)
    args = TrainingArguments(output_dir=str(out / "hf"), max_steps=steps, per_device_train_batch_size=batch_size,
                             per_device_eval_batch_size=windows.batch_size, learning_rate=1e-3, warmup_steps=0,
                             lr_scheduler_type="constant", logging_steps=1, eval_strategy="no", save_strategy="no",
                             report_to=[], use_cpu=True, seed=seed, data_seed=seed, dataloader_num_workers=0,
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=windows_dataset(train_windows),
                      eval_dataset=windows_dataset(windows), compute_loss_func=lm_compute_loss, callbacks=[callback],
                      optimizers=(optimizer, None))
    trainer.train()
    own = trainer.evaluate()
    return {"trainer_eval_loss": own["eval_loss"], "fleet_records": callback.records, "served": callback.served,
            "export": str(callback.export_dir), "curvature_ready": bool(optimizer.rule.curv.ready),
            "multipliers": [float(m) for m in optimizer.rule._multipliers()],
            "rounds": optimizer.book.stats(optimizer.rule.log_prefix), "probe_forwards": optimizer.backend.forward_passes}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--coordinator", default=os.environ.get("SPARECYCLES_COORDINATOR_URL"),
                   help="coordinator URL (default: SPARECYCLES_COORDINATOR_URL; none: all in process)")
    p.add_argument("--out", type=Path, default=Path("runs/hf-trainer"), help="run folder")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps")
    a = p.parse_args()
    text = json.dumps(main(a.coordinator, a.out, steps=a.steps), default=str, indent=2)
    (a.out / "result.json").write_text(text)
    print(text)
