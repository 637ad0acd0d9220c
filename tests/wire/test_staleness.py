"""The staleness rule once (wire.staleness): its Lua twin, which the intake script runs, agrees with
`is_stale` on every (version, latest, S) of a grid, and the Python callers (curvature state, in-process
backend) decide as it does."""

from __future__ import annotations

import itertools

import redis

from coordinator.intake_scripts import INTAKE
from wire.staleness import IS_STALE_LUA, is_stale, oldest_fresh

BIG = 2**53 - 1  # the largest Version: Lua's doubles must still subtract it exactly
GRID = list(itertools.product([0, 1, 2, 5, 9, 10, BIG - 3, BIG], [-1, 0, 1, 3, 9, 10, 12, BIG], [0, 1, 2, 7, 1_000_000]))


def test_lua_twin_equals_is_stale_over_a_grid(redis_url):
    r = redis.Redis.from_url(redis_url)
    script = r.register_script(IS_STALE_LUA + """
local out = {}
for i = 1, #ARGV, 3 do
  out[#out + 1] = is_stale(tonumber(ARGV[i]), tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])) and 1 or 0
end
return out""")
    lua = script(args=[x for row in GRID for x in row])
    assert [bool(x) for x in lua] == [is_stale(v, latest, s) for v, latest, s in GRID]
    assert sum(lua) > 0 and sum(lua) < len(GRID)  # the grid has both sides of the rule
    assert INTAKE.startswith(IS_STALE_LUA) and "is_stale(" in INTAKE[len(IS_STALE_LUA):]


def test_rule_and_its_floor():
    assert not is_stale(8, 10, 2) and is_stale(7, 10, 2)  # 10 - 8 = S is fresh; 10 - 7 > S
    assert not is_stale(0, 10**9, None)  # no bound
    assert not is_stale(5, -1, 0)  # nothing published yet
    for v, latest, s in GRID:
        assert is_stale(v, latest, s) == (v < oldest_fresh(latest, s))


def test_trainer_callers_use_the_rule():
    """The round book drops an incomplete round exactly when the rule calls it stale."""
    from trainer.zo.probes import RoundSpec
    from trainer.zo.rounds import RoundBook

    class Hold:  # a backend that keeps every round in flight
        latest_version = None

        def submit(self, probe_round) -> None:
            pass

    for v, latest, _ in GRID:
        if 0 <= v < 2**53 and 0 <= latest < 10**6:
            book = RoundBook(2)
            book.issue(Hold(), [RoundSpec("r", v, None, 1e-2, (1,))])
            assert book.due(latest) == [] and (book.dropped == 1) == is_stale(v, latest, 2)
