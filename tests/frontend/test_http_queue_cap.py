"""Row 5 across frontends: the engine-wide queue cap (``--max-waiting-requests``).

One ``conveyor serve --frontends 2 --max-num-seqs 1 --max-waiting-requests 2`` per module, with
the step trace on. A burst of requests over both frontends must split into 200s and 429s (never
anything else), every 429 must carry Retry-After and come before any stream starts, every 200 must
carry the exact greedy text, and the engine's waiting queue, as its own step trace records it,
must never hold more than the cap, whichever frontend the requests came through.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from conveyor.frontend.engine_client import MPEngineClient
from tests.frontend.http_helpers import (
    ServedHttp,
    get,
    metric,
    parse_metrics,
    post_json,
    read_to_end,
    send_completion,
    start_served_http,
    stream_text,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("http-queue-cap")]

MAX_WAITING = 2
NUM_BURST = 12
MAX_TOKENS = 24
GREEDY = {"prompt": "def main():", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedHttp]:
    folder = tmp_path_factory.mktemp("queue-cap")
    extra = ["--frontends", "2", "--max-num-seqs", "1", "--enable-debug-queries"]
    extra += ["--max-waiting-requests", str(MAX_WAITING)]
    extra += ["--trace-steps", str(folder / "steps.jsonl")]
    served = start_served_http(tiny_model_dir, folder / "serve.log", extra)
    try:
        yield served
    finally:
        served.stop()


def _send(served: ServedHttp, stream: bool, results: list[tuple[bool, bytes]]) -> None:
    sock = send_completion(served.base_url, {**GREEDY, "stream": stream})
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\0" * 8)
    try:
        # Whole responses: the server closes nothing, so read until the body is complete.
        raw = read_to_end(sock) if stream else _read_whole(sock)
    finally:
        sock.close()
    results.append((stream, raw))


def _read_whole(sock: socket.socket) -> bytes:
    received = b""
    while b"\r\n\r\n" not in received:
        received += sock.recv(65536)
    head, _, body = received.partition(b"\r\n\r\n")
    length = int(next(x for x in head.split(b"\r\n") if x.lower().startswith(b"content-length"))
                 .split(b":")[1])  # fmt: skip
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def _status_and_headers(raw: bytes) -> tuple[int, dict[str, str]]:
    head = raw.partition(b"\r\n\r\n")[0].decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in head[1:])
    return int(head[0].split()[1]), headers


def test_a_burst_over_two_frontends_never_queues_past_the_cap(served):
    status, _, body = post_json(served.base_url, "/v1/completions", GREEDY)
    assert status == 200, body
    reference = body["choices"][0]["text"]

    results: list[tuple[bool, bytes]] = []
    threads = [
        threading.Thread(target=_send, args=(served, i % 2 == 0, results)) for i in range(NUM_BURST)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60.0)
    assert len(results) == NUM_BURST

    statuses = []
    for stream, raw in results:
        status, headers = _status_and_headers(raw)
        statuses.append(status)
        body = raw.partition(b"\r\n\r\n")[2]
        if status == 429:
            # Refused before anything was streamed: an OpenAI error body, not an SSE stream.
            assert int(headers["retry-after"]) >= 1 and b"data:" not in body
            error = json.loads(body)["error"]
            assert error["type"] == "RateLimitError" and "queue is full" in error["message"]
            continue
        assert status == 200, raw[:300]
        if stream:
            assert stream_text(body) == (reference, "length")
        else:
            assert json.loads(body)["choices"][0]["text"] == reference
    # The first MAX_WAITING to arrive always fit the empty queue; one more fits only if the
    # engine scheduled the first before the next ones arrived (it takes every queued arrival
    # before it schedules, so a tight burst may not give it the chance), and a request that
    # arrives after others finished may be admitted too: the split is not fixed, but a burst of
    # 12 against room for 3 must see refusals.
    assert statuses.count(429) >= 1 and statuses.count(200) >= MAX_WAITING, statuses

    trace = served.log.with_name("steps.jsonl")  # flushed: the engine is idle again
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert records and max(r["num_waiting"] for r in records) <= MAX_WAITING

    # Each frontend counts the refusals it answered as finish reason "rejected"; a scrape of
    # either one reports them all (new connections spread over both frontends).
    for _ in range(10):
        samples = parse_metrics(get(served.base_url, "/metrics")[1])
        rejected = metric(samples, "conveyor:request_success_total", finished_reason="rejected")
        assert rejected == statuses.count(429)

    def all_free() -> bool:
        client = MPEngineClient(address=served.engine_address, ready_timeout_s=10.0)
        try:
            client.check_all_free(5.0)
            return True
        except AssertionError:
            return False
        finally:
            client.shutdown()

    assert wait_for(all_free, 10.0, 0.5)
