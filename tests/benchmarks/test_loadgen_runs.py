"""The load generator's client and runner against the fake server: the numbers it was told to make.

The fake server streams with known delays, so TTFT, ITL and counts are checked against its
configuration; the schedule, concurrency cap, cancels and failures against what it saw.
"""

from __future__ import annotations

import asyncio
import math
import socket
import time

import numpy as np
import pytest
from aiohttp import web

from conveyor.bench.loadgen.client import Endpoint
from conveyor.bench.loadgen.datasets import (
    DatasetSpec,
    PromptMaker,
    SampleRequest,
    load_tokenizer,
    make_dataset,
)
from conveyor.bench.loadgen.metrics import summarize
from conveyor.bench.loadgen.runner import (
    RunResult,
    TrafficSpec,
    arrival_offsets,
    cancel_points,
    open_session,
)
from conveyor.bench.loadgen.runner import run_requests as runner_run_requests


def word_samples(num: int, input_len: int = 8, output_len: int = 5) -> list[SampleRequest]:
    spec = DatasetSpec(random_input_len=input_len, random_output_len=output_len)
    return make_dataset(spec, num, seed=0, maker=PromptMaker(None, endpoint_takes_ids=True))


def run(
    base_url: str,
    samples: list[SampleRequest],
    traffic: TrafficSpec | None = None,
    kind: str = "completions",
    api_key: str | None = None,
) -> RunResult:
    endpoint = Endpoint(base_url, "fake-model", kind, api_key)
    traffic = traffic or TrafficSpec()

    async def go() -> RunResult:
        async with open_session(traffic.max_concurrency, request_timeout_s=30.0) as session:
            stop = asyncio.Event()
            return await runner_run_requests(session, endpoint, samples, traffic, stop, False)

    return asyncio.run(go())


def wait_for(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_fixed_delays_give_that_ttft_and_itl(fake_server):
    server = fake_server(ttft_ms=60, itl_ms=15)
    result = run(server.base_url, word_samples(4, output_len=6))
    outs = result.outputs
    assert [o.success for o in outs] == [True] * 4
    assert [o.output_tokens for o in outs] == [6] * 4  # from the usage chunk
    assert [o.num_chunks for o in outs] == [6] * 4
    assert [o.prompt_len for o in outs] == [8] * 4
    # Upper bounds leave room for a busy machine (the suite runs beside other tests).
    for out in outs:
        assert 0.058 <= out.ttft < 0.25
        assert len(out.itl) == 5 and 0.0135 <= np.median(out.itl) < 0.05
        assert 0.058 + 5 * 0.015 <= out.latency < 0.5
    metrics = summarize(result, {})
    assert metrics["completed"] == 4 and metrics["total_output_tokens"] == 24
    assert 13.5 <= metrics["mean_tpot_ms"] < 50 and 13.5 <= metrics["median_itl_ms"] < 50


def test_chat_and_a_server_without_usage_still_count_exactly(fake_server):
    server = fake_server(ttft_ms=40, itl_ms=2, usage=False)
    outs = run(server.base_url, word_samples(3, output_len=7), kind="chat").outputs
    assert all(o.success for o in outs)
    # The role chunk carries no content: not a token, and not the first token's time.
    assert [o.output_tokens for o in outs] == [7] * 3
    assert all(o.ttft >= 0.038 for o in outs)
    body = server.stats.bodies[0]
    assert body["messages"][0]["role"] == "user" and body["max_completion_tokens"] == 7


def test_request_bodies_carry_token_ids_and_the_api_key(fake_server, tiny_model_dir):
    server = fake_server(api_key="sesame")
    maker = PromptMaker(load_tokenizer(str(tiny_model_dir)), endpoint_takes_ids=True)
    samples = make_dataset(DatasetSpec(random_input_len=12, random_output_len=3), 2, 0, maker)
    outs = run(server.base_url, samples, api_key="sesame").outputs
    assert all(o.success and o.prompt_len == 12 for o in outs)
    # The two requests run concurrently: the server may have received either first.
    bodies = server.stats.bodies
    assert sorted(b["prompt"] for b in bodies) == sorted(s.prompt for s in samples)
    assert all(len(b["prompt"]) == 12 for b in bodies)
    body = bodies[0]
    assert body["max_tokens"] == 3 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    refused = run(server.base_url, samples, api_key="wrong").outputs
    assert [o.error for o in refused] == ["HTTP 401: invalid API key"] * 2


def test_requests_leave_on_the_seeded_schedule_until_the_duration(fake_server):
    server = fake_server(itl_ms=1)
    traffic = TrafficSpec(request_rate=40.0, duration_s=1.0, seed=5)
    result = run(server.base_url, word_samples(200, output_len=3), traffic)
    offsets = arrival_offsets(200, 40.0, 1.0, np.random.default_rng(5))
    expected = int((offsets < 1.0).sum())
    assert 25 <= expected <= 60  # about rate * duration
    assert abs(len(result.outputs) - expected) <= 1
    assert result.num_not_sent == 200 - len(result.outputs)
    sent = np.array(sorted(o.start_time - result.start_time for o in result.outputs))
    assert np.median(np.abs(sent - offsets[: len(sent)])) < 0.005
    assert np.diff(sent).mean() == pytest.approx(1 / 40.0, rel=0.35)
    assert all(o.success for o in result.outputs)


def test_duration_ends_a_closed_loop_run(fake_server):
    # Rate inf behind a concurrency cap is a closed loop; --duration stops it sending.
    server = fake_server(itl_ms=10)
    traffic = TrafficSpec(max_concurrency=2, duration_s=0.5)
    result = run(server.base_url, word_samples(200, output_len=3), traffic)
    sent = len(result.outputs)  # about 2 per 20 ms on an idle machine
    assert 1 <= sent <= 100 and result.num_not_sent == 200 - sent
    assert all(o.success for o in result.outputs)
    assert max(o.start_time - result.start_time for o in result.outputs) < 0.5
    assert result.duration < 1.5  # the last ones sent just finish
    assert server.stats.num_requests == sent


def test_max_concurrency_caps_what_the_server_sees(fake_server):
    server = fake_server(itl_ms=5)
    result = run(server.base_url, word_samples(24, output_len=4), TrafficSpec(max_concurrency=3))
    assert all(o.success for o in result.outputs) and len(result.outputs) == 24
    assert server.stats.max_active == 3
    metrics = summarize(result, {})
    assert metrics["peak_in_flight_requests"] == 3
    # vLLM's 1 s buckets count every request that touched the busiest second.
    assert 3 <= metrics["max_concurrent_requests"] <= 24
    assert max(o.queue_time for o in result.outputs) > 0.05  # later ones waited for a slot


def test_cancel_rate_drops_streams_and_the_server_sees_it(fake_server):
    server = fake_server(itl_ms=20)
    samples = word_samples(40, output_len=10)
    traffic = TrafficSpec(cancel_rate=0.5, seed=2)
    result = run(server.base_url, samples, traffic)
    rng = np.random.default_rng(2)
    arrival_offsets(40, math.inf, 1.0, rng)  # the runner's draws, in its order
    points = cancel_points(samples, 0.5, rng)
    num_dropped = sum(p is not None for p in points)
    assert 10 <= num_dropped <= 30
    metrics = summarize(result, {})
    assert metrics["cancelled"] == num_dropped
    assert metrics["completed"] == 40 - num_dropped and metrics["failed"] == 0
    assert metrics["cancelled_output_tokens"] == sum(p for p in points if p is not None)
    # The server sees a drop at its next write; one dropped just before the end can race the
    # last writes into the socket buffer and look complete to it.
    stats = server.stats
    assert wait_for(lambda: stats.num_active == 0)
    assert stats.num_completed + stats.num_disconnected == 40
    assert num_dropped // 2 <= stats.num_disconnected <= num_dropped


def test_failures_are_counted_with_their_reasons(fake_server):
    server = fake_server(fail_every=4, max_tokens_limit=50)
    samples = [SampleRequest("a b c", 3, 100 if i in (1, 6) else 5, True) for i in range(12)]
    result = run(server.base_url, samples, TrafficSpec(max_concurrency=1))
    metrics = summarize(result, {})
    assert (metrics["completed"], metrics["failed"]) == (7, 5)
    assert metrics["failure_reasons"] == {
        "HTTP 500: injected failure": 3,
        "HTTP 400: max_tokens exceeds the fake server's limit": 2,
    }


def test_an_unreachable_server_fails_with_the_exception_type():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again below: nothing listens there
    result = run(f"http://127.0.0.1:{port}", word_samples(3))
    reasons = summarize(result, {})["failure_reasons"]
    assert sum(reasons.values()) == 3
    assert all(reason.startswith("ClientConnectorError") for reason in reasons)


def test_a_server_that_queues_delays_the_first_token_only(fake_server):
    # Two streams generate at once; the others wait for a slot, so TTFT comes in steps of one
    # request's time (4 gaps of 10 ms) while the gaps between tokens stay 10 ms.
    server = fake_server(itl_ms=10, max_running=2)
    outs = run(server.base_url, word_samples(6, output_len=5)).outputs
    assert all(o.success for o in outs)
    ttfts = sorted(o.ttft for o in outs)
    assert ttfts[1] < 0.03 and ttfts[2] >= 0.038 and ttfts[4] >= 0.078
    assert np.median([gap for o in outs for gap in o.itl]) < 0.03


def serve_script(events: list[tuple[float, bytes]]):
    """An aiohttp app whose completions endpoint writes ``events`` (delay in s, bytes) in order."""

    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for delay_s, data in events:
            await asyncio.sleep(delay_s)
            await response.write(data)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", stream)
    return app


def run_against_script(
    events: list[tuple[float, bytes]], num: int = 1, traffic: TrafficSpec | None = None
) -> RunResult:
    """run() against serve_script(events), started and stopped on the run's own loop."""

    async def go() -> RunResult:
        runner = web.AppRunner(serve_script(events), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            endpoint = Endpoint(f"http://127.0.0.1:{port}", "m")
            async with open_session(None, request_timeout_s=10.0) as session:
                return await runner_run_requests(
                    session,
                    endpoint,
                    word_samples(num),
                    traffic or TrafficSpec(),
                    asyncio.Event(),
                    False,
                )
        finally:
            await runner.cleanup()

    return asyncio.run(go())


def sse(payload: str) -> bytes:
    return f"data: {payload}\n\n".encode()


TOKEN = sse('{"choices": [{"index": 0, "text": " tok"}]}')
USAGE = sse('{"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 2}}')


def test_e2e_latency_ends_at_the_last_token_not_at_done():
    # vllm bench serve ends E2E at the last token chunk: a server slow to send usage and [DONE]
    # after it must not lengthen E2E (nor TPOT, which is derived from it).
    events = [(0.05, TOKEN), (0.05, TOKEN), (0.4, USAGE), (0.0, sse("[DONE]"))]
    (out,) = run_against_script(events).outputs
    assert out.success and out.output_tokens == 2 and len(out.itl) == 1
    assert out.latency == pytest.approx(out.ttft + sum(out.itl))
    assert 0.09 <= out.latency < 0.3


@pytest.mark.parametrize(
    "payload",
    [
        "[1, 2]",
        '"x"',
        "5",
        "null",
        '{"choices": "x"}',
        '{"choices": ["x"]}',
        '{"choices": [{"delta": "x"}]}',
        '{"usage": 5}',
        '{"usage": {"completion_tokens": "2"}}',
    ],
)
def test_a_chunk_of_the_wrong_shape_fails_the_request_not_the_run(payload):
    events = [(0.0, TOKEN), (0.0, sse(payload)), (0.0, TOKEN), (0.0, sse("[DONE]"))]
    result = run_against_script(events, num=3)
    metrics = summarize(result, {})
    assert (metrics["completed"], metrics["failed"]) == (0, 3)
    (reason,) = metrics["failure_reasons"]
    assert reason.startswith("malformed stream chunk (") and payload[:20] in reason
