"""What the data-parallel router costs per request, for each policy, engine count and prompt length.

Runs on its own, in one process, with no engine. It times exactly what a frontend does on its event
loop to route one request (``EngineGroupClient._choose``: read each engine's up state and latest
stats, then ``Router.choose``), with stand-in engine clients whose stats change as often as a
busy engine's do (a new ``SchedulerStats`` every few requests). The prompts follow a shared-prefix
workload: each starts with one of a few dozen system prompts and ends with its own tokens, so the
prefix-affinity table fills up and is looked up as in serving. Usage::

    python -m benchmarks router [--engines 2 4 16] [--prompt-lens 256 1024 4096] [--requests 20000]
        [--json]

The goal is under 50 us per request: a frontend handles a few thousand requests a second at most,
so routing should never be what it spends its time on.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, cast

from conveyor.bench.machine import machine_info
from conveyor.frontend.engine_client.engine_group import EngineGroupClient
from conveyor.frontend.engine_client.router import ROUTER_POLICIES, Router, RouterConfig
from conveyor.protocol import EngineCoreRequest, SamplingParams, SchedulerStats

BLOCK_SIZE = 16
NUM_SYSTEM_PROMPTS = 32
# A new stats message from some engine every this many requests (a busy engine steps every few
# milliseconds; a frontend sees a request every millisecond or so).
STATS_EVERY = 4
NUM_ROUNDS = 5


@dataclass
class _StandInEngine:
    """What ``_choose`` reads of an engine client."""

    stats: SchedulerStats | None = None
    dead_reason: str | None = None


def _prompts(num: int, prompt_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system_len = prompt_len // 2
    systems = [[rng.randrange(32000) for _ in range(system_len)] for _ in range(NUM_SYSTEM_PROMPTS)]
    return [
        rng.choice(systems) + [rng.randrange(32000) for _ in range(prompt_len - system_len)]
        for _ in range(num)
    ]


def _group(policy: str, num_engines: int) -> tuple[EngineGroupClient, list[_StandInEngine]]:
    engines = [_StandInEngine(SchedulerStats()) for _ in range(num_engines)]
    group = object.__new__(EngineGroupClient)  # no sockets: only what routing reads
    group._members = cast(Any, engines)
    group.router = Router(num_engines, RouterConfig(policy, 4.0, BLOCK_SIZE))
    return group, engines


def time_routing(policy: str, num_engines: int, prompt_len: int, num_requests: int) -> float:
    """Microseconds per routed request (the median of ``NUM_ROUNDS`` rounds)."""
    params = SamplingParams()
    requests = [
        EngineCoreRequest(str(i), prompt, params, 0.0)
        for i, prompt in enumerate(_prompts(num_requests, prompt_len, seed=num_engines))
    ]
    rng = random.Random(0)
    updates = [
        (
            rng.randrange(num_engines),
            SchedulerStats(rng.randrange(64), rng.randrange(8), rng.random()),
        )
        for _ in range(num_requests // STATS_EVERY + 1)
    ]
    rounds = []
    for _ in range(NUM_ROUNDS):
        group, engines = _group(policy, num_engines)
        started = time.perf_counter_ns()
        for i, request in enumerate(requests):
            if i % STATS_EVERY == 0:
                engine, stats = updates[i // STATS_EVERY]
                engines[engine].stats = stats
            group._choose(request)
        rounds.append((time.perf_counter_ns() - started) / num_requests / 1000)
    return statistics.median(rounds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks router", description=__doc__)
    parser.add_argument("--engines", type=int, nargs="+", default=[2, 4, 16])
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--policies", nargs="+", choices=ROUTER_POLICIES, default=ROUTER_POLICIES)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    rows = []
    for policy in args.policies:
        for num_engines in args.engines:
            for prompt_len in args.prompt_lens:
                us = time_routing(policy, num_engines, prompt_len, args.requests)
                rows.append(
                    {"policy": policy, "engines": num_engines, "prompt_len": prompt_len, "us": us}
                )
    report = {"machine": machine_info(), "block_size": BLOCK_SIZE, "rows": rows}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"router cost per request (us, median of {NUM_ROUNDS} rounds of {args.requests})")
    print(f"{'policy':>16} {'engines':>8} {'prompt':>8} {'us':>8}")
    for row in rows:
        print(f"{row['policy']:>16} {row['engines']:>8} {row['prompt_len']:>8} {row['us']:>8.2f}")
    worst = max(row["us"] for row in rows)
    print(f"worst: {worst:.2f} us ({'within' if worst < 50 else 'over'} the 50 us goal)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
