"""`sparecycles up`'s embedded Valkey from a relative run folder (`--run-dir runs/x`)."""

from __future__ import annotations

from pathlib import Path

import redis

from sparecycles.services import Supervisor, redis_url_or_embedded


def test_embedded_valkey_starts_from_a_relative_data_dir(tmp_path, monkeypatch):
    # Valkey runs with cwd=data_dir; a relative --dir used to resolve twice and abort its start-up.
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("REDIS_URL", raising=False)
    sup = Supervisor(tmp_path / "logs")
    try:
        with redis_url_or_embedded(Path("runs/x/valkey"), sup) as (url, desc):
            assert desc.startswith("embedded Valkey")
            client = redis.Redis.from_url(url)
            assert client.set("k", b"v") and client.get("k") == b"v"
            client.close()
    finally:
        sup.stop_all()
    assert (tmp_path / "runs" / "x" / "valkey").is_dir()
    assert not (tmp_path / "runs" / "x" / "valkey" / "runs").exists()
    assert all(p.poll() is not None for p in sup.children.values())
