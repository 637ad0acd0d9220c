"""Helpers of the torchrun tests: launch `sparecycles train` under torchrun, find a rank's process, read losses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def launch(nproc: int, *train_args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`torchrun --standalone --nproc-per-node nproc -m sparecycles.cli train ...`, output captured (text)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "sparecycles.cli", "train", *train_args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def rank_pid(torchrun_pid: int, rank: int) -> int | None:
    """The pid of `rank`, a child of the torchrun process `torchrun_pid` (its RANK variable), or None."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == torchrun_pid and f"RANK={rank}".encode() in (d / "environ").read_bytes().split(b"\0"):
                return int(d.name)
        except (OSError, IndexError, ValueError):
            continue
    return None


def losses(run_dir: Path) -> list[tuple[int, str, float]]:
    """(step, "loss" | "val_loss", value) of every record of metrics.jsonl."""
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], k, r[k]) for r in recs for k in ("loss", "val_loss") if k in r]
