"""The data-parallel router: least loaded, prefix affinity and its margin, round robin, engines
going down and coming back. Pure Python, no engine."""

from __future__ import annotations

import pytest

from conveyor.frontend.engine_client.router import (
    AFFINITY_PREFIX_TOKENS,
    NoEngineError,
    Router,
    RouterConfig,
    prefix_block_hashes,
)
from conveyor.protocol import SchedulerStats

BLOCK = 4


def router(policy: str, num_engines: int = 2, margin: float = 2.0) -> Router:
    return Router(num_engines, RouterConfig(policy, margin, BLOCK))


def stats(running: int = 0, waiting: int = 0, kv: float = 0.0) -> SchedulerStats:
    return SchedulerStats(num_running=running, num_waiting=waiting, kv_cache_usage=kv)


def prompt(prefix: int, length: int = 3 * BLOCK, tail: int = 0) -> list[int]:
    """``length`` tokens whose first two blocks depend on ``prefix`` only."""
    ids = [prefix * 1000 + i for i in range(2 * BLOCK)]
    return ids + [tail * 7 + i for i in range(length - len(ids))]


def test_round_robin_takes_turns_and_skips_an_engine_that_is_down():
    r = router("round-robin", 3)
    assert [r.choose([1]) for _ in range(4)] == [0, 1, 2, 0]
    r.set_up(1, False)
    assert [r.choose([1]) for _ in range(3)] == [2, 0, 2]


def test_least_loaded_follows_the_engines_stats():
    r = router("least-loaded", 3)
    r.observe_stats(0, stats(running=5))
    r.observe_stats(1, stats(running=1, waiting=3))
    r.observe_stats(2, stats(running=2))
    assert r.choose([1]) == 2


def test_kv_usage_breaks_a_tie_in_requests():
    r = router("least-loaded")
    r.observe_stats(0, stats(running=3, kv=0.9))
    r.observe_stats(1, stats(running=3, kv=0.2))
    assert r.choose([1]) == 1


def test_requests_routed_since_the_last_stats_count_until_new_stats_come():
    """A burst between two stats messages spreads instead of piling on the engine that looked
    idle; the engine's next stats (which include those requests) replace the count."""
    r = router("least-loaded")
    r.observe_stats(0, stats(running=2))
    r.observe_stats(1, stats(running=0))
    assert [r.choose([1]) for _ in range(4)] == [1, 1, 0, 1]
    assert r.load(1) == 3
    new = stats(running=3)
    r.observe_stats(1, new)
    assert r.load(1) == 3  # from the stats alone, which count those requests now
    r.observe_stats(0, stats(running=9))
    assert r.choose([1]) == 1 and r.load(1) == 4
    r.observe_stats(1, new)  # the same message again: nothing new, the count stays
    assert r.load(1) == 4


def test_idle_engines_share_a_burst():
    r = router("least-loaded", 4)
    assert sorted(r.choose([1]) for _ in range(8)) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_prefix_affinity_sends_a_shared_prefix_back_to_its_engine():
    r = router("prefix-affinity", margin=2.0)
    first = r.choose(prompt(1, tail=1))
    other = r.choose(prompt(2, tail=1))  # a new prefix goes to the least loaded: the other one
    assert other != first
    # Same first blocks, different rest: the engine that served them, though it is now as
    # loaded as the other (within the margin).
    assert r.choose(prompt(1, tail=2)) == first
    assert r.choose(prompt(2, tail=3)) == other
    assert r.num_affinity_hits == 2


def test_the_longest_shared_prefix_wins():
    r = router("prefix-affinity", margin=100.0)
    system = [9] * (2 * BLOCK)
    a = r.choose(system + [1] * (2 * BLOCK))  # engine 0
    b = r.choose([5] * (4 * BLOCK))  # an unrelated prompt to engine 1
    r._remember(prefix_block_hashes(system + [2] * (2 * BLOCK), BLOCK), b)
    # The conversation continues: its whole history matches engine a deeper than the system
    # prompt alone matches engine b.
    assert r.choose(system + [1] * (2 * BLOCK) + [3] * BLOCK) == a


def test_affinity_gives_way_when_its_engine_is_loaded_past_the_margin():
    r = router("prefix-affinity", margin=2.0)
    owner = r.choose(prompt(1))
    r.observe_stats(owner, stats(running=2))  # 2 over the other: still within the margin
    r.observe_stats(1 - owner, stats(running=0))
    assert r.choose(prompt(1, tail=5)) == owner
    r.observe_stats(owner, stats(running=5))  # 5 over the other: past the margin
    moved = r.choose(prompt(1, tail=6))
    assert moved == 1 - owner
    # The prefix now belongs to the engine that served it last.
    r.observe_stats(owner, stats(running=0))
    r.observe_stats(moved, stats(running=1))
    assert r.choose(prompt(1, tail=7)) == moved


def test_a_prompt_shorter_than_a_block_goes_to_the_least_loaded():
    r = router("prefix-affinity")
    r.observe_stats(0, stats(running=1))
    assert r.choose([1, 2]) == 1
    assert prefix_block_hashes([1, 2], BLOCK) == []


def test_an_engine_that_is_down_is_never_chosen():
    r = router("prefix-affinity", margin=10.0)
    owner = r.choose(prompt(1))
    r.set_up(owner, False)
    assert {r.choose(prompt(1, tail=i)) for i in range(4)} == {1 - owner}


def test_a_restarted_engine_forgets_the_prefixes_it_had():
    r = router("prefix-affinity", margin=10.0)
    owner = r.choose(prompt(1))
    r.set_up(owner, False)
    r.set_up(owner, True)  # restarted: its prefix cache is empty
    r.observe_stats(owner, stats(running=3))
    r.observe_stats(1 - owner, stats(running=0))
    # Within the margin it would have kept the prefix; restarted, it has nothing to offer.
    assert r.choose(prompt(1, tail=2)) == 1 - owner


def test_no_engine_up_raises():
    for policy in ("round-robin", "least-loaded", "prefix-affinity"):
        r = router(policy)
        r.set_up(0, False)
        r.set_up(1, False)
        with pytest.raises(NoEngineError):
            r.choose(prompt(1))


def test_only_the_first_tokens_are_hashed_and_the_table_is_bounded(monkeypatch):
    long_prompt = list(range(AFFINITY_PREFIX_TOKENS * 3))
    assert len(prefix_block_hashes(long_prompt, BLOCK)) == AFFINITY_PREFIX_TOKENS // BLOCK
    monkeypatch.setattr("conveyor.frontend.engine_client.router.MAX_AFFINITY_ENTRIES", 64)
    r = router("prefix-affinity")
    for i in range(100):
        r.choose(prompt(i))
    assert len(r._owners) <= 64


def test_bad_router_settings_are_refused():
    with pytest.raises(ValueError, match="router policy"):
        RouterConfig("random")
    with pytest.raises(ValueError, match="margin"):
        RouterConfig("least-loaded", -1.0)
