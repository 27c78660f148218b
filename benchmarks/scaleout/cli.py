"""``python -m benchmarks scaleout``: 1 to 16 simulated engines behind the router, per routing policy.

Runs in the benchmark's own process. The step time is fitted to a real engine's step trace
(``--trace FILE``, or ``--record-trace FILE --model DIR`` to record one first on this workload);
without either, the fit recorded for the bench model on the 2-core machine is used. Two tables:

* **scaling**: each engine count at a load past its capacity (the rate that saturates one engine,
  times the count): output tok/s, and its ratio to the count times one engine's;
* **latency**: the largest engine count at a share of its capacity (``--load``): TTFT and TPOT
  percentiles and the prefix cache hit rate per policy.

Usage::

    python -m benchmarks scaleout [--record-trace FILE --model DIR | --trace FILE]
        [--engines 1,2,4,8,16] [--duration-s 120] [--load 0.7] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from benchmarks.scaleout.simulate import SimConfig, SimResult, Simulation
from benchmarks.scaleout.step_cost_fit import (
    BENCH_MODEL_COST,
    BENCH_TRACE,
    StepCost,
    fit_trace_file,
)
from benchmarks.scaleout.workload import Workload, WorkloadConfig
from conveyor.bench.machine import machine_info
from conveyor.frontend.engine_client.router import DEFAULT_AFFINITY_MARGIN, ROUTER_POLICIES

# Sessions per second that saturate one engine are searched for from here, doubling.
_FIRST_RATE = 0.25
_SATURATED_BUSY = 0.98


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks scaleout", description=__doc__)
    parser.add_argument("--trace", type=Path, help="fit the step time to this step trace")
    parser.add_argument("--record-trace", type=Path, help="record a trace first (needs --model)")
    parser.add_argument("--model", help="the model to record the trace with")
    parser.add_argument("--record-sessions", type=int, default=48)
    parser.add_argument("--engines", default="1,2,4,8,16")
    parser.add_argument("--duration-s", type=float, default=120.0, help="simulated seconds")
    parser.add_argument("--load", type=float, default=0.7, help="latency table: share of capacity")
    parser.add_argument("--num-blocks", type=int, default=4096, help="KV blocks per engine")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--affinity-margin", type=float, default=DEFAULT_AFFINITY_MARGIN)
    parser.add_argument(
        "--margins", default="2,4,8,16,32", help="latency table: prefix-affinity at these margins"
    )
    parser.add_argument("--seed", type=int, default=0, help="the workload's")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def _cost(args: argparse.Namespace) -> tuple[StepCost, str, float | None]:
    if args.record_trace:
        if not args.model:
            raise SystemExit("--record-trace needs --model")
        from benchmarks.scaleout.record import record_trace

        record_trace(
            args.model,
            args.record_trace,
            args.record_sessions,
            args.max_num_seqs,
            args.max_num_batched_tokens,
            WorkloadConfig(),
        )
        args.trace = args.record_trace
    if args.trace:
        cost, error = fit_trace_file(args.trace)
        return cost, str(args.trace), error
    return BENCH_MODEL_COST, f"built-in (the fit of {BENCH_TRACE})", None


class _Runner:
    def __init__(self, args: argparse.Namespace, cost: StepCost) -> None:
        self.args, self.cost = args, cost

    def run(
        self, num_engines: int, policy: str, rate: float, margin: float | None = None
    ) -> SimResult:
        args = self.args
        config = SimConfig(
            num_engines=num_engines,
            policy=policy,
            rate=rate,
            duration_s=args.duration_s,
            affinity_margin=args.affinity_margin if margin is None else margin,
            num_blocks=args.num_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            workload=WorkloadConfig(seed=args.seed),
        )
        return Simulation(config, self.cost).run()

    def saturating_rate(self) -> float:
        """Sessions per second past one engine's capacity: doubled until it is always busy and
        its output stops growing, then doubled once more."""
        rate, previous = _FIRST_RATE, 0.0
        while True:
            result = self.run(1, "least-loaded", rate)
            if result.busy_share >= _SATURATED_BUSY and result.output_tok_s < 1.1 * previous:
                return 2 * rate
            previous = result.output_tok_s
            rate *= 2


def _row(result: SimResult, **extra: float) -> dict[str, object]:
    return {**dataclasses.asdict(result), **extra}


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    engine_counts = [int(n) for n in args.engines.split(",")]
    cost, source, fit_error = _cost(args)
    runner = _Runner(args, cost)
    overload = runner.saturating_rate()
    scaling: list[dict[str, object]] = []
    single: dict[str, float] = {}
    for num_engines in engine_counts:
        for policy in ROUTER_POLICIES:
            result = runner.run(num_engines, policy, overload * num_engines)
            single.setdefault(policy, result.output_tok_s / num_engines)
            ideal = num_engines * single[policy]
            scaling.append(_row(result, vs_ideal=result.output_tok_s / ideal))
    # One engine's capacity in sessions per second, from its saturated output.
    per_session = Workload(WorkloadConfig(seed=args.seed)).mean_output_tokens_per_session()
    capacity = max(single.values()) / per_session
    largest = max(engine_counts)
    rate = args.load * largest * capacity
    latency = [_row(runner.run(largest, policy, rate)) for policy in ROUTER_POLICIES]
    margins = [float(m) for m in args.margins.split(",")] if args.margins else []
    sweep = [
        _row(runner.run(largest, "prefix-affinity", rate, margin), margin=margin)
        for margin in margins
    ]
    report = {
        "machine": machine_info(),
        "step_cost": {"source": source, "mean_relative_error": fit_error, **cost.as_dict()},
        "config": {k: v for k, v in vars(args).items() if not isinstance(v, Path)},
        "one_engine_capacity_sessions_per_s": capacity,
        "scaling": scaling,
        "latency": {"num_engines": largest, "load": args.load, "rate": rate, "rows": latency},
        "margin_sweep": sweep,
    }
    if args.json:
        print(json.dumps(report, default=str))
    else:
        _print(report)
    return 0


def _print(report: dict) -> None:
    cost = report["step_cost"]
    print(f"step cost from {cost['source']}: " + ", ".join(
        f"{k} {v:.3g}" for k, v in cost.items() if k not in ("source", "mean_relative_error")
    ) + (f" (mean relative error {cost['mean_relative_error']:.1%})"
         if cost["mean_relative_error"] is not None else ""))  # fmt: skip
    print(f"one engine's capacity: {report['one_engine_capacity_sessions_per_s']:.2f} sessions/s")
    print("\nscaling (load past capacity):")
    print(f"{'engines':>8} {'policy':>16} {'out tok/s':>10} {'vs N x one':>10} {'hit rate':>9}")
    for row in report["scaling"]:
        print(
            f"{row['num_engines']:>8} {row['policy']:>16} {row['output_tok_s']:>10.0f} "
            f"{row['vs_ideal']:>10.3f} {row['prefix_hit_rate']:>9.1%}"
        )
    latency = report["latency"]
    print(
        f"\nlatency ({latency['num_engines']} engines at {latency['load']:.0%} of capacity, "
        f"{latency['rate']:.2f} sessions/s):"
    )
    print(
        f"{'policy':>16} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
        f"{'TPOT p99':>9} {'hit rate':>9}"
    )
    for row in latency["rows"]:
        print(
            f"{row['policy']:>16} {row['output_tok_s']:>10.0f} {row['ttft_p50_ms']:>9.0f} "
            f"{row['ttft_p99_ms']:>9.0f} {row['tpot_p50_ms']:>9.1f} {row['tpot_p99_ms']:>9.1f} "
            f"{row['prefix_hit_rate']:>9.1%}"
        )
    if report["margin_sweep"]:
        print("\nprefix-affinity by margin (same load):")
        print(f"{'margin':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p99':>9} {'hit rate':>9}")
    for row in report["margin_sweep"]:
        print(
            f"{row['margin']:>8g} {row['ttft_p50_ms']:>9.0f} {row['ttft_p99_ms']:>9.0f} "
            f"{row['tpot_p99_ms']:>9.1f} {row['prefix_hit_rate']:>9.1%}"
        )


if __name__ == "__main__":
    sys.exit(main())
