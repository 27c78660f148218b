"""Draw a step trace: batch composition, step time and KV usage over time.

    conveyor serve --model DIR --trace-steps /tmp/steps.jsonl     # or LLM(trace_steps=...)
    conveyor plot-trace /tmp/steps.jsonl --out /tmp/steps.png

Top: prompt (prefill) vs generated (decode) tokens of each step, stacked — the picture of the
Orca and Sarathi-Serve papers: under stall-free scheduling decodes ride along with prompt chunks
in every step; under prefill-first, prompt-only steps stall the decodes. Middle: how long each
step took. Bottom: KV cache usage and the running / waiting queues. Prints a summary as well.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from conveyor.engine_core.step_trace import StepTraceRecord, read_trace


def summarize(records: list[StepTraceRecord]) -> dict[str, float]:
    durations = sorted(r.duration_ms for r in records)
    prefill = sum(r.num_prefill_tokens for r in records)
    decode = sum(r.num_decode_tokens for r in records)
    return {
        "steps": len(records),
        "seconds": records[-1].time - records[0].time + durations[0] / 1e3,
        "prefill_tokens": prefill,
        "decode_tokens": decode,
        "mixed_steps": sum(1 for r in records if r.num_prefill_tokens and r.num_decode_tokens),
        "mean_step_ms": round(statistics.fmean(durations), 3),
        "median_step_ms": round(statistics.median(durations), 3),
        "p99_step_ms": round(durations[min(len(durations) - 1, int(0.99 * len(durations)))], 3),
        "max_kv_cache_usage": max(r.kv_cache_usage for r in records),
        "max_waiting": max(r.num_waiting for r in records),
        "preemptions": records[-1].num_preemptions - records[0].num_preemptions,
    }


def plot(records: list[StepTraceRecord], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = [r.time for r in records]
    widths = [max(r.duration_ms / 1e3, 1e-4) for r in records]
    starts = [t - w for t, w in zip(times, widths)]
    prefill = [r.num_prefill_tokens for r in records]
    decode = [r.num_decode_tokens for r in records]
    fig, (tokens, duration, memory) = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    tokens.bar(starts, decode, widths, align="edge", color="tab:blue", label="decode tokens")
    tokens.bar(
        starts, prefill, widths, bottom=decode, align="edge", color="tab:orange", label="prefill"
    )
    tokens.set_ylabel("tokens / step")
    tokens.legend(loc="upper right")
    tokens.set_title(title)
    duration.plot(times, [r.duration_ms for r in records], ".", markersize=3, color="tab:red")
    duration.set_ylabel("step ms")
    memory.plot(times, [100 * r.kv_cache_usage for r in records], color="tab:green", label="KV %")
    memory.set_ylabel("KV cache used %")
    queues = memory.twinx()
    queues.plot(times, [r.num_running for r in records], color="tab:blue", label="running")
    queues.plot(times, [r.num_waiting for r in records], color="tab:gray", label="waiting")
    queues.set_ylabel("requests")
    queues.legend(loc="upper right")
    memory.set_xlabel("seconds since the engine started")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="conveyor plot-trace", description=__doc__.splitlines()[0]
    )
    parser.add_argument("trace", type=Path, help="a file written by --trace-steps")
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default: TRACE.png)")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    records = read_trace(args.trace)
    if not records:
        print(f"{args.trace}: no steps recorded", file=sys.stderr)
        return 1
    for key, value in summarize(records).items():
        print(f"{key:>20}: {value}")
    out = args.out or args.trace.with_suffix(".png")
    plot(records, out, args.title or args.trace.name)
    print(f"{'plot':>20}: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
