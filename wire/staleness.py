"""The staleness rule, once (DESIGN.md §3): a result or round taken at `version` is stale when it is older
than latest − S, i.e. latest − version > S, for the bound S >= 0 in versions (RunSpec.staleness).

Pure and torch-free, so the trainer (trainer.zo.rounds, trainer.zo.backend) and the
coordinator (coordinator.runs) call the same function. The coordinator's intake decides inside a Redis Lua
script; `IS_STALE_LUA` is this rule's Lua twin, prepended to that script (coordinator.intake_scripts) and tested against `is_stale` over
a grid of (version, latest, S) by tests/wire/test_staleness.py. Versions are < 2**53 (messages.Version), so Lua's
doubles hold them and their differences exactly.
"""

from __future__ import annotations


def is_stale(version: int, latest: int, staleness: int | None) -> bool:
    """True when `version` is older than `latest` − `staleness` (latest − version > S); never with S None (no
    bound). `latest` may be below `version` (a round at a version not yet published) or −1 (none yet)."""
    return staleness is not None and latest - version > staleness


def oldest_fresh(latest: int, staleness: int) -> int:
    """The oldest version not stale at `latest` under bound S: latest − S (every older one `is_stale`)."""
    return latest - staleness


# `is_stale` in Lua: the intake script starts with this definition (coordinator.intake_scripts.INTAKE).
IS_STALE_LUA = """
local function is_stale(version, latest, staleness) return latest - version > staleness end
"""
