"""The load generator's numbers: throughput, latency statistics, goodput, and the summary table.

Runs in the load generator's process (conveyor bench serve), after a run. Key names follow
``vllm bench serve`` (completed, failed, request_throughput, mean_ttft_ms, p99_itl_ms, ...), so
result files compare directly. Latency statistics cover completed requests only; requests the
client dropped on purpose (--cancel-rate) are counted as ``cancelled``, neither completed nor
failed. TPOT of a request is (E2E latency - TTFT) / (output tokens - 1); requests with one output
token have none (and count as TPOT 0 for goodput, as vLLM does). The peaks follow vLLM too, in
1 s buckets over completed requests: ``max_output_tokens_per_s`` is the busiest bucket's content
chunks, ``max_concurrent_requests`` the most requests active in one bucket (requests that follow
each other within a second all count); ``peak_in_flight_requests`` is the exact peak instead.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from conveyor.bench.loadgen.client import RequestOutput
from conveyor.bench.loadgen.runner import RunResult

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
CLIENT_BUSY_CORES = 0.8
LATENCY_METRICS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


def parse_goodput(pairs: Iterable[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(
                f"--goodput takes NAME:MS with NAME in {GOODPUT_METRICS}, got {pair!r}"
            )
        slos[name] = float(value)
        if slos[name] < 0:
            raise ValueError(f"--goodput {pair!r}: the SLO must be non-negative")
    return slos


def request_tpot(out: RequestOutput) -> float:
    """Seconds per output token after the first; 0 for a request with at most one token."""
    if out.output_tokens <= 1:
        return 0.0
    return (out.latency - out.ttft) / (out.output_tokens - 1)


def meets_slos(out: RequestOutput, slos_ms: dict[str, float]) -> bool:
    """Whether a completed request met every given SLO (ttft, tpot, e2el in milliseconds)."""
    values = {"ttft": out.ttft, "tpot": request_tpot(out), "e2el": out.latency}
    return all(values[name] * 1000.0 <= limit for name, limit in slos_ms.items())


def latency_stats(
    name: str, seconds: Sequence[float], percentiles: Sequence[float]
) -> dict[str, float]:
    """mean/median/std and the percentiles of one latency, in ms (0 when there are none)."""
    values = np.asarray(seconds if len(seconds) else [0.0], dtype=float) * 1000.0
    stats = {
        f"mean_{name}_ms": float(values.mean()),
        f"median_{name}_ms": float(np.median(values)),
        f"std_{name}_ms": float(values.std()),
    }
    for p in percentiles:
        stats[f"p{_percentile_word(p)}_{name}_ms"] = float(np.percentile(values, p))
    return stats


def _percentile_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def output_tokens_per_second(
    outputs: Iterable[RequestOutput], start: float | None = None
) -> np.ndarray:
    """Output tokens of completed requests per 1 s bucket, counted as ``vllm bench serve`` does.

    Each content chunk is one token in the bucket of its arrival (a chunk that carries several
    tokens still counts one, as in vLLM). Buckets start at ``start`` (perf_counter seconds),
    by default at the earliest start of a completed request, vLLM's origin.
    """
    done = [o for o in outputs if o.success and o.num_chunks > 0]
    if not done:
        return np.zeros(0)
    origin = min(o.start_time for o in done) if start is None else start
    arrivals = np.concatenate(
        [o.start_time + o.ttft + np.concatenate(([0.0], np.cumsum(o.itl))) for o in done]
    )
    return np.bincount(np.floor(np.maximum(arrivals - origin, 0.0)).astype(int)).astype(float)


def concurrent_requests_per_second(outputs: Iterable[RequestOutput]) -> np.ndarray:
    """Completed requests active in each 1 s bucket, counted as ``vllm bench serve`` does.

    Buckets start at the earliest start of a completed request; a request counts in every bucket
    from the one it starts in to the one it ends in, both included. So short requests one after
    another within a second all count there: this is a per-second load, not the exact peak
    (``max_concurrency_seen`` is that).
    """
    done = [o for o in outputs if o.success]
    if not done:
        return np.zeros(0)
    origin = min(o.start_time for o in done)
    first = np.array([int(o.start_time - origin) for o in done])
    last = np.array([int(o.start_time + o.latency - origin) for o in done])
    steps = np.zeros(last.max() + 2)
    np.add.at(steps, first, 1)
    np.add.at(steps, last + 1, -1)
    return np.cumsum(steps)[:-1]


def max_concurrency_seen(outputs: Iterable[RequestOutput]) -> int:
    """Exact peak of requests in flight (every sent request, over [start, start + latency))."""
    events = sorted(
        [(o.start_time, 1) for o in outputs] + [(o.start_time + o.latency, -1) for o in outputs]
    )
    peak = level = 0
    for _, step in events:  # at equal times -1 sorts first: an end frees its slot
        level += step
        peak = max(peak, level)
    return peak


def summarize(
    run: RunResult, slos_ms: dict[str, float], percentiles: Sequence[float] = (90, 99)
) -> dict[str, Any]:
    """The metrics of one run, with vLLM's key names."""
    done = [o for o in run.outputs if o.success]
    failed = [o for o in run.outputs if not o.success and not o.cancelled]
    cancelled = [o for o in run.outputs if o.cancelled]
    duration = max(run.duration, 1e-9)
    total_input = sum(o.prompt_len for o in done)
    total_output = sum(o.output_tokens for o in done)
    tokens_per_second = output_tokens_per_second(done)
    active_per_second = concurrent_requests_per_second(done)
    result: dict[str, Any] = {
        "duration": run.duration,
        "completed": len(done),
        "failed": len(failed),
        "cancelled": len(cancelled),
        "interrupted": run.num_interrupted,
        "not_sent": run.num_not_sent,
        "failure_reasons": dict(Counter(o.error for o in failed).most_common()),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "cancelled_output_tokens": sum(o.output_tokens for o in cancelled),
        "request_throughput": len(done) / duration,
        "request_goodput": sum(meets_slos(o, slos_ms) for o in done) / duration
        if slos_ms
        else None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "max_output_tokens_per_s": _peak(tokens_per_second),
        "max_concurrent_requests": int(_peak(active_per_second)),
        "peak_in_flight_requests": max_concurrency_seen(run.outputs),
        # asyncio runs on one core: near 1.0 the client, not the server, sets the pace.
        "client_cpu_cores": run.client_cpu_seconds / duration,
    }
    samples = {
        "ttft": [o.ttft for o in done],
        "tpot": [request_tpot(o) for o in done if o.output_tokens > 1],
        "itl": [gap for o in done for gap in o.itl],
        "e2el": [o.latency for o in done],
    }
    for name, _, _ in LATENCY_METRICS:
        result.update(latency_stats(name, samples[name], percentiles))
    return result


def _peak(per_second: np.ndarray) -> float:
    return float(per_second.max()) if len(per_second) else 0.0


def detailed(run: RunResult) -> dict[str, list[Any]]:
    """Per-request arrays (vLLM's --save-detailed fields); start times relative to the run."""
    outs = run.outputs
    return {
        "input_lens": [o.prompt_len for o in outs],
        "output_lens": [o.output_tokens for o in outs],
        "ttfts": [o.ttft for o in outs],
        "itls": [o.itl for o in outs],
        "latencies": [o.latency for o in outs],
        "start_times": [o.start_time - run.start_time for o in outs],
        "queue_times": [o.queue_time for o in outs],
        "errors": [o.error for o in outs],
        "cancelled": [o.cancelled for o in outs],
    }


def format_summary(result: dict[str, Any], percentiles: Sequence[float] = (90, 99)) -> str:
    """The "Serving Benchmark Result" block, laid out like vLLM's."""
    lines = ["{:=^50}".format(" Serving Benchmark Result ")]
    row = "{:<40} {:<10}".format
    num = "{:<40} {:<10.2f}".format
    lines += [
        row("Successful requests:", result["completed"]),
        row("Failed requests:", result["failed"]),
        row("Cancelled requests (client):", result["cancelled"]),
    ]
    if result["interrupted"]:
        lines.append(row("Interrupted requests (Ctrl-C):", result["interrupted"]))
    for reason, count in result["failure_reasons"].items():
        lines.append(f"  {count:>6} x {reason}")
    lines += [
        num("Benchmark duration (s):", result["duration"]),
        row("Total input tokens:", result["total_input_tokens"]),
        row("Total generated tokens:", result["total_output_tokens"]),
        num("Request throughput (req/s):", result["request_throughput"]),
    ]
    if result["request_goodput"] is not None:
        lines.append(num("Request goodput (req/s):", result["request_goodput"]))
    lines += [
        num("Output token throughput (tok/s):", result["output_throughput"]),
        num("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"]),
        row("Peak concurrent requests:", result["max_concurrent_requests"]),
        row("Peak in-flight requests (exact):", result["peak_in_flight_requests"]),
        num("Total token throughput (tok/s):", result["total_token_throughput"]),
        num("Client CPU (cores):", result["client_cpu_cores"]),
    ]
    if result["client_cpu_cores"] > CLIENT_BUSY_CORES:
        lines.append("  warning: the client was nearly saturated; latencies include its own delays")
    for name, label, header in LATENCY_METRICS:
        lines.append(f"{header:-^50}")
        lines.append(num(f"Mean {label} (ms):", result[f"mean_{name}_ms"]))
        lines.append(num(f"Median {label} (ms):", result[f"median_{name}_ms"]))
        lines.append(num(f"Std {label} (ms):", result[f"std_{name}_ms"]))
        for p in percentiles:
            word = _percentile_word(p)
            lines.append(num(f"P{word} {label} (ms):", result[f"p{word}_{name}_ms"]))
    lines.append("=" * 50)
    return "\n".join(lines)
