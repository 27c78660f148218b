"""Which data-parallel engine serves a request: the frontend's router.

Runs in an HTTP frontend process, on its event loop: one ``choose`` per engine request, no I/O
and no waiting. It judges load from what the engines already send with their outputs
(``SchedulerStats``: running and waiting requests, KV cache usage; every step to the clients that
have outputs, and once a second to all), never by asking, plus what only this frontend knows:
the requests it routed to an engine since that engine's last stats, which those stats cannot
show yet. Without that count, a burst that arrives between two stats messages would all go to
the engine that looked idle.

Policies (``ROUTER_POLICIES``):
  ``round-robin``      each engine in turn, blind to load (the baseline);
  ``least-loaded``     the engine with the fewest requests (waiting + running + just routed),
                       KV usage breaking ties;
  ``prefix-affinity``  (default) the engine that last served the longest prefix this prompt
                       shares (hashed by whole KV blocks, as the engines' prefix caches are), so
                       its prefix is likely still cached there, unless that engine's load exceeds
                       the least loaded engine's by more than ``affinity_margin`` requests; then
                       the least loaded, which becomes the prefix's engine from now on.

An engine that goes down is never chosen; when it comes back its cache is empty, so what the
router remembered about its prefixes is forgotten (an epoch per engine, not a sweep).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from conveyor.protocol import SchedulerStats

ROUTER_POLICIES: tuple[str, ...] = ("prefix-affinity", "least-loaded", "round-robin")
# How much more loaded (in requests) the prefix's engine may be than the least loaded before
# a request leaves it: a cached prefix saves its prefill, a queue of a few requests costs a few
# steps' wait. 8 from the scale-out simulation (`python -m benchmarks scaleout`, 16 engines at
# 70 % of capacity): 2 and 4 lose cache hits and p99 TTFT, 16 and 32 gain little more hit rate
# and lengthen p99 TPOT. Tunable with --router-affinity-margin.
DEFAULT_AFFINITY_MARGIN = 8.0
# Only a prompt's first tokens are hashed: enough to tell system prompts and conversations apart,
# while hashing stays a few microseconds (a chained hash per block is ~0.3 us per 16 tokens).
AFFINITY_PREFIX_TOKENS = 1024
# Prefix hashes remembered; the oldest are forgotten first (about 4 MB at this size).
MAX_AFFINITY_ENTRIES = 1 << 16


class NoEngineError(RuntimeError):
    """No engine is up to take the request."""


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "prefix-affinity"
    affinity_margin: float = DEFAULT_AFFINITY_MARGIN
    # The engines' KV block size: prefixes are compared by whole blocks, as the engines cache them.
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.policy not in ROUTER_POLICIES:
            raise ValueError(
                f"router policy must be one of {', '.join(ROUTER_POLICIES)}, got {self.policy!r}"
            )
        if self.affinity_margin < 0:
            raise ValueError(f"affinity margin must be >= 0, got {self.affinity_margin}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")


def prefix_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """A chained hash per full block of the prompt's first ``AFFINITY_PREFIX_TOKENS`` tokens:
    equal hashes at depth k mean (barring collisions) equal first k blocks."""
    num_tokens = min(len(token_ids), AFFINITY_PREFIX_TOKENS)
    num_tokens -= num_tokens % block_size
    hashes: list[int] = []
    parent = 0
    for start in range(0, num_tokens, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return hashes


class Router:
    """Chooses among ``num_engines`` engines; engine ``i`` is the i-th address the frontend got."""

    def __init__(self, num_engines: int, config: RouterConfig = RouterConfig()) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        self.config = config
        self.num_engines = num_engines
        self._stats: list[SchedulerStats | None] = [None] * num_engines
        # Routed here since the engine's latest stats (which do not count them yet).
        self._num_routed: list[int] = [0] * num_engines
        self._up = [True] * num_engines
        self._epochs = [0] * num_engines
        self._next = 0  # round-robin position, and where ties start
        # prefix hash -> (engine, the engine's epoch when it served that prefix)
        self._owners: dict[int, tuple[int, int]] = {}
        self.num_affinity_hits = 0

    # ------------------------------------------------------------------ what the router hears

    def observe_stats(self, engine: int, stats: SchedulerStats | None) -> None:
        """The engine's latest stats (cheap to call with the same object again: each message
        is a new object, so only a new one resets the count of requests routed since)."""
        if stats is not None and stats is not self._stats[engine]:
            self._stats[engine] = stats
            self._num_routed[engine] = 0

    def set_up(self, engine: int, up: bool) -> None:
        """An engine went down (never chosen) or came back (its prefixes start over)."""
        if up and not self._up[engine]:
            self._epochs[engine] += 1
            self._stats[engine] = None
            self._num_routed[engine] = 0
        self._up[engine] = up

    def is_up(self, engine: int) -> bool:
        return self._up[engine]

    def load(self, engine: int) -> float:
        """Requests the engine holds or will soon hold, plus its KV usage (0..1) as a tie-break:
        of two engines with as many requests, the one with more free blocks."""
        stats = self._stats[engine]
        routed = self._num_routed[engine]
        if stats is None:
            return float(routed)
        return stats.num_waiting + stats.num_running + routed + stats.kv_cache_usage

    # ------------------------------------------------------------------ choosing

    def choose(self, prompt_token_ids: Sequence[int]) -> int:
        """The engine for a request with this prompt (counted as routed there)."""
        policy = self.config.policy
        if policy == "round-robin":
            engine = self._round_robin()
        elif policy == "least-loaded":
            engine = self._least_loaded()
        else:
            engine = self._prefix_affinity(prompt_token_ids)
        self._num_routed[engine] += 1
        return engine

    def choose_other(self, excluded: set[int]) -> int | None:
        """The least loaded engine that is up and not in ``excluded`` (counted as routed
        there), or None: where a request some engines refused (their queue cap) goes next."""
        candidates = [e for e in range(self.num_engines) if self._up[e] and e not in excluded]
        if not candidates:
            return None
        engine = min(candidates, key=self.load)
        self._num_routed[engine] += 1
        return engine

    def _round_robin(self) -> int:
        for offset in range(self.num_engines):
            engine = (self._next + offset) % self.num_engines
            if self._up[engine]:
                self._next = engine + 1
                return engine
        raise NoEngineError("no engine is up")

    def _least_loaded(self) -> int:
        """The least loaded engine; ties go round in turn, so idle engines share a burst."""
        best, best_load = -1, 0.0
        n = self.num_engines
        for offset in range(n):
            engine = (self._next + offset) % n
            if self._up[engine]:
                load = self.load(engine)
                if best < 0 or load < best_load:
                    best, best_load = engine, load
        if best < 0:
            raise NoEngineError("no engine is up")
        self._next = best + 1
        return best

    def _prefix_affinity(self, prompt_token_ids: Sequence[int]) -> int:
        least = self._least_loaded()
        hashes = prefix_block_hashes(prompt_token_ids, self.config.block_size)
        owner = self._owner_of(hashes)
        margin = self.config.affinity_margin
        engine = least
        if owner is not None and self.load(owner) <= self.load(least) + margin:
            engine = owner
        if owner == engine:
            self.num_affinity_hits += 1
        self._remember(hashes, engine)
        return engine

    def _owner_of(self, hashes: list[int]) -> int | None:
        """The engine that served the longest remembered prefix of these, if it is still up
        and has not restarted since."""
        owners, epochs, up = self._owners, self._epochs, self._up
        for block_hash in reversed(hashes):
            entry = owners.get(block_hash)
            if entry is not None:
                engine, epoch = entry
                if up[engine] and epochs[engine] == epoch:
                    return engine
        return None

    def _remember(self, hashes: list[int], engine: int) -> None:
        owners = self._owners
        entry = (engine, self._epochs[engine])
        for block_hash in hashes:
            owners[block_hash] = entry
        if len(owners) > MAX_AFFINITY_ENTRIES:
            # A dict keeps insertion order, so the first keys are the oldest (FIFO, not LRU: a
            # hot prefix forgotten here is remembered again by its next request). An eighth at
            # once keeps the cost per request a fraction of a microsecond.
            for block_hash in list(itertools.islice(owners, MAX_AFFINITY_ENTRIES // 8)):
                del owners[block_hash]
