"""The Prometheus scrape configuration of the fleet `sparecycles up` runs: `<run folder>/prometheus.yml`.

Its jobs are ops/prometheus.yml's (`coordinator`, `trainer`, `probe-worker`), so the Grafana dashboard and the
alert rules of ops/ apply unchanged; its targets are the ports this `up` bound (free ports, new on every start).
The file exists while the services run: `up` removes it when it stops them.
"""

from __future__ import annotations

import json
from pathlib import Path

SCRAPE_CONFIG = "prometheus.yml"
JOBS = ("coordinator", "trainer", "probe-worker")


def write_scrape_config(path: Path, targets: dict[str, list[str]], interval_s: float = 5.0) -> Path:
    """Write a Prometheus configuration scraping `targets` (job name in JOBS -> ["host:port", ...]) every
    `interval_s` seconds to `path`; returns `path`. JSON is YAML: no YAML writer needed.
    Raises ValueError for a job not in JOBS."""
    unknown = set(targets) - set(JOBS)
    if unknown:
        raise ValueError(f"unknown scrape jobs {sorted(unknown)}; expected some of {JOBS}")
    config = {
        "global": {"scrape_interval": f"{interval_s:g}s", "evaluation_interval": f"{interval_s:g}s"},
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets[job]}]}
                           for job in JOBS if targets.get(job)],
    }
    header = (f"# Written by `sparecycles up` for the services it runs now (removed when they stop):\n"
              f"#   prometheus --config.file={path}\n"
              "# The jobs are ops/prometheus.yml's: ops/grafana's dashboard and ops/alerts.yml apply as they are.\n")
    path.write_text(header + json.dumps(config, indent=2) + "\n")
    return path
