"""bench/loadgen/metrics.py and the arrival schedule, on hand-made samples (no server)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conveyor.bench.loadgen.client import RequestOutput
from conveyor.bench.loadgen.datasets import SampleRequest
from conveyor.bench.loadgen.metrics import (
    concurrent_requests_per_second,
    format_summary,
    latency_stats,
    max_concurrency_seen,
    meets_slos,
    output_tokens_per_second,
    parse_goodput,
    request_tpot,
    summarize,
)
from conveyor.bench.loadgen.runner import RunResult, arrival_offsets, cancel_points


def done(ttft: float, itl: list[float], tokens: int | None = None, start: float = 0.0):
    """A completed request: latency is TTFT plus its gaps, as the client measures it."""
    out = RequestOutput(prompt_len=10, expected_output_len=len(itl) + 1, success=True)
    out.ttft, out.itl, out.start_time = ttft, list(itl), start
    out.num_chunks = len(itl) + 1
    out.output_tokens = out.num_chunks if tokens is None else tokens
    out.latency = ttft + sum(itl)
    return out


def failed(error: str) -> RequestOutput:
    return RequestOutput(prompt_len=10, expected_output_len=5, error=error, latency=0.01)


def test_tpot_and_goodput_on_hand_made_requests():
    fast = done(0.100, [0.020] * 10)  # TPOT 20 ms, E2E 300 ms
    slow_start = done(0.900, [0.020] * 10)  # TTFT 900 ms
    slow_tokens = done(0.100, [0.080] * 10)  # TPOT 80 ms, E2E 900 ms
    single = done(0.050, [])  # one token: no TPOT, counts as 0 for goodput
    assert request_tpot(fast) == pytest.approx(0.020)
    assert request_tpot(slow_tokens) == pytest.approx(0.080)
    assert request_tpot(single) == 0.0
    slos = parse_goodput(["ttft:500", "tpot:50"])
    assert slos == {"ttft": 500.0, "tpot": 50.0}
    assert [meets_slos(o, slos) for o in (fast, slow_start, slow_tokens, single)] == [
        True,
        False,
        False,
        True,
    ]
    assert meets_slos(slow_tokens, {"e2el": 900.5}) and not meets_slos(slow_tokens, {"e2el": 899})
    run = RunResult([fast, slow_start, slow_tokens, single], 2.0, 0.0, np.zeros(4))
    assert summarize(run, slos)["request_goodput"] == pytest.approx(2 / 2.0)
    assert summarize(run, {})["request_goodput"] is None
    for bad in (["ttft"], ["latency:5"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_latency_stats_keys_and_values():
    stats = latency_stats("itl", [0.001, 0.002, 0.003, 0.004], (90, 99, 99.9))
    assert stats["mean_itl_ms"] == pytest.approx(2.5)
    assert stats["median_itl_ms"] == pytest.approx(2.5)
    assert stats["std_itl_ms"] == pytest.approx(np.std([1, 2, 3, 4]))
    assert stats["p90_itl_ms"] == pytest.approx(3.7)
    assert set(stats) == {
        "mean_itl_ms",
        "median_itl_ms",
        "std_itl_ms",
        "p90_itl_ms",
        "p99_itl_ms",
        "p99.9_itl_ms",
    }
    assert latency_stats("ttft", [], (99,))["p99_ttft_ms"] == 0.0


def test_summary_counts_failures_by_reason_and_keeps_cancels_apart():
    ok = [done(0.1, [0.01] * 4, start=i * 0.5) for i in range(3)]
    dropped = RequestOutput(prompt_len=10, expected_output_len=5, cancelled=True, output_tokens=2)
    outs = ok + [
        failed("HTTP 500: boom"),
        failed("HTTP 500: boom"),
        failed("TimeoutError"),
        dropped,
    ]
    result = summarize(RunResult(outs, 2.0, 0.0, np.zeros(len(outs))), {})
    assert (result["completed"], result["failed"], result["cancelled"]) == (3, 3, 1)
    assert result["failure_reasons"] == {"HTTP 500: boom": 2, "TimeoutError": 1}
    assert result["total_output_tokens"] == 15 and result["cancelled_output_tokens"] == 2
    assert result["total_input_tokens"] == 30
    assert result["request_throughput"] == pytest.approx(1.5)
    assert result["output_throughput"] == pytest.approx(7.5)
    assert result["total_token_throughput"] == pytest.approx(22.5)
    assert result["mean_ttft_ms"] == pytest.approx(100.0)
    assert result["mean_tpot_ms"] == pytest.approx(10.0)
    assert result["mean_e2el_ms"] == pytest.approx(140.0)
    table = format_summary(result)
    assert "Serving Benchmark Result" in table and "2 x HTTP 500: boom" in table
    assert "P99 ITL (ms):" in table and "Cancelled requests (client):" in table
    assert "warning" not in table
    busy = RunResult(outs, 2.0, 0.0, np.zeros(len(outs)), client_cpu_seconds=1.9)
    assert summarize(busy, {})["client_cpu_cores"] == pytest.approx(0.95)
    assert "the client was nearly saturated" in format_summary(summarize(busy, {}))


def test_throughput_bins_and_peak_concurrency():
    # Tokens at 0.2, 0.7, 1.2, 1.7, 2.2 s and at 1.5, 1.6 s.
    a = done(0.2, [0.5] * 4, start=0.0)
    b = done(0.5, [0.1], start=1.0)
    assert output_tokens_per_second([a, b], start=0.0).tolist() == [2, 4, 1]
    assert max_concurrency_seen([a, b]) == 2  # a runs 0..2.2, b 1.0..1.6
    back_to_back = [done(0.5, [], start=0.0), done(0.5, [], start=0.5)]
    assert max_concurrency_seen(back_to_back) == 1  # one ends as the next starts


def test_peaks_use_vllms_one_second_buckets_over_completed_requests():
    # vllm bench serve: buckets start at the earliest completed request's start; each content
    # chunk counts one token in the bucket it arrived in; a request is active in every bucket
    # from the one it starts in to the one it ends in, both included.
    late = done(0.2, [0.5, 0.5], start=0.7)  # chunks at 0.9, 1.4, 1.9: 0.2, 0.7, 1.2 from 0.7
    early_failure = failed("HTTP 500: boom")  # starts at 0.0, moves no bucket
    assert output_tokens_per_second([late, early_failure]).tolist() == [2, 1]
    assert output_tokens_per_second([late], start=0.0).tolist() == [1, 2]  # the plot's origin
    # Several tokens in one chunk (usage says 10 for 5 chunks) still count one, as in vLLM.
    bundled = done(0.2, [0.5] * 4, tokens=10)
    assert output_tokens_per_second([bundled]).tolist() == [2, 2, 1]
    # Five 0.1 s requests one after another: never two at once, but five in bucket 0.
    serial = [done(0.1, [], start=0.1 * i) for i in range(5)]
    assert concurrent_requests_per_second(serial).tolist() == [5]
    assert max_concurrency_seen(serial) == 1
    # [0, 1) and [1, 2) touch bucket 1 both: vLLM counts 2 there.
    touching = [done(1.0, [], start=0.0), done(1.0, [], start=1.0)]
    assert concurrent_requests_per_second(touching).tolist() == [1, 2, 1]
    result = summarize(RunResult([*serial, late, failed("x")], 2.0, 0.0, np.zeros(7)), {})
    assert result["max_concurrent_requests"] == 6  # bucket 0: the five and late
    assert result["max_output_tokens_per_s"] == 6.0  # bucket 0: five single chunks and 0.9 s
    # The exact peak counts every sent request: the failure (0 to 10 ms) overlaps the first.
    assert result["peak_in_flight_requests"] == 2
    assert "Peak in-flight requests (exact):" in format_summary(result)
    assert concurrent_requests_per_second([failed("x")]).tolist() == []


def test_arrivals_have_the_rate_and_the_burstiness_asked():
    rng = np.random.default_rng(0)
    assert arrival_offsets(5, math.inf, 1.0, rng).tolist() == [0.0] * 5
    assert arrival_offsets(4, 2.0, math.inf, rng).tolist() == [0.0, 0.5, 1.0, 1.5]
    variations = {}
    for burstiness in (0.25, 1.0, 4.0):
        offsets = arrival_offsets(20001, 10.0, burstiness, np.random.default_rng(1))
        gaps = np.diff(offsets)
        assert offsets[0] == 0.0 and gaps.mean() == pytest.approx(0.1, rel=0.05)
        variations[burstiness] = gaps.std() / gaps.mean()
    # Gamma gaps: coefficient of variation 1 / sqrt(shape).
    assert variations[0.25] == pytest.approx(2.0, rel=0.1)
    assert variations[1.0] == pytest.approx(1.0, rel=0.05)
    assert variations[4.0] == pytest.approx(0.5, rel=0.05)
    same = arrival_offsets(10, 3.0, 1.0, np.random.default_rng(7))
    assert same.tolist() == arrival_offsets(10, 3.0, 1.0, np.random.default_rng(7)).tolist()


def test_cancel_points_drop_about_the_fraction_asked_before_the_end():
    samples = [SampleRequest("x", 1, 20, True)] * 4000
    points = cancel_points(samples, 0.3, np.random.default_rng(0))
    dropped = [p for p in points if p is not None]
    assert len(dropped) / len(points) == pytest.approx(0.3, abs=0.03)
    assert min(dropped) == 0 and max(dropped) == 19
    assert all(p is None for p in cancel_points(samples[:50], 0.0, np.random.default_rng(0)))
    with pytest.raises(ValueError):
        cancel_points(samples, 1.5, np.random.default_rng(0))
