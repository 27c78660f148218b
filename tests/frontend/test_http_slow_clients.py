"""Row 19: slow and hostile clients are cut at deadlines and never hold a place in the queue.

One ``conveyor serve`` per module with one frontend, ``--max-queued-requests 4``, a 2 s request
read timeout and a 2 s keep-alive timeout. Slow uploads (a byte every half second), slow headers,
silent connections and a huge header run against it; meanwhile ordinary requests must be served
(never a 429 because of the slow ones), and the slow ones are closed near their deadlines.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.frontend.http_helpers import (
    MODEL_NAME,
    ServedHttp,
    frontend_pids,
    post_json,
    read_to_end,
    rss_bytes,
    start_served_http,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("http-slow-clients")]

MAX_IN_FLIGHT = 4
READ_TIMEOUT_S = 2.0
IDLE_TIMEOUT_S = 2.0
# The deadline plus slack for a busy 2-core machine (what matters is that the cut comes at all:
# without the deadline these connections stay open for as long as the client trickles).
SLACK_S = 3.0
CUT_WITHIN_S = READ_TIMEOUT_S + SLACK_S
GREEDY = {"model": MODEL_NAME, "prompt": "def main():", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedHttp]:
    log = tmp_path_factory.mktemp("slow") / "serve.log"
    extra = ["--frontends", "1", "--max-queued-requests", str(MAX_IN_FLIGHT)]
    extra += ["--request-read-timeout-s", str(READ_TIMEOUT_S)]
    extra += ["--keep-alive-timeout-s", str(IDLE_TIMEOUT_S)]
    served = start_served_http(tiny_model_dir, log, extra)
    try:
        yield served
    finally:
        served.stop()


def _connect(served: ServedHttp) -> socket.socket:
    return socket.create_connection(("127.0.0.1", served.port), timeout=30)


def _trickle(sock: socket.socket, data: bytes, interval_s: float, stop: threading.Event) -> None:
    """Send ``data`` a byte at a time until it is all sent, the server closes, or ``stop``."""
    for byte in data:
        if stop.wait(interval_s):
            return
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            return


def _closed_after(sock: socket.socket) -> tuple[bytes, float]:
    """What the server sent before closing, and how long after the call it closed."""
    start = time.monotonic()
    # No stream here: it reads until the server closes (or resets) the connection.
    received = read_to_end(sock)
    return received, time.monotonic() - start


def test_slow_uploads_hold_no_place_and_are_cut_at_their_deadline(served):
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 200\r\n\r\n"
    )
    stop = threading.Event()
    socks = [_connect(served) for _ in range(MAX_IN_FLIGHT)]
    trickles = []
    for sock in socks:
        sock.sendall(head)
        trickles.append(threading.Thread(target=_trickle, args=(sock, b"x" * 200, 0.5, stop)))
        trickles[-1].start()
    try:
        time.sleep(0.5)  # every slow upload has begun
        # As many ordinary requests as the cap, while the slow ones hold their connections:
        # all served, because an upload takes no place until its body is here.
        for _ in range(MAX_IN_FLIGHT + 1):
            status, _, body = post_json(served.base_url, "/v1/completions", GREEDY)
            assert status == 200, body
        for sock in socks:
            received, after_s = _closed_after(sock)
            assert received.startswith(b"HTTP/1.1 408"), received[:100]
            assert after_s < CUT_WITHIN_S, f"cut after {after_s:.1f} s more"
    finally:
        stop.set()
        for thread in trickles:
            thread.join(10)
        for sock in socks:
            sock.close()


def test_slow_headers_are_cut_and_silent_connections_closed(served):
    stop = threading.Event()
    slow = _connect(served)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"y" * 100 + b"\r\n\r\n"
    started = time.monotonic()
    trickle = threading.Thread(target=_trickle, args=(slow, head, 0.3, stop))
    trickle.start()
    silent = _connect(served)
    try:
        received, _ = _closed_after(slow)
        assert received.startswith(b"HTTP/1.1 408"), received[:100]
        assert time.monotonic() - started < CUT_WITHIN_S
        received, _ = _closed_after(silent)
        # Nothing was asked, so nothing is answered: the connection just ends.
        assert received == b"" and time.monotonic() - started < IDLE_TIMEOUT_S + SLACK_S
    finally:
        stop.set()
        trickle.join(10)
        slow.close()
        silent.close()
    status, _, body = post_json(served.base_url, "/v1/completions", GREEDY)
    assert status == 200, body


def test_a_huge_header_gets_431_at_once_and_memory_stays_flat(served):
    (frontend,) = frontend_pids(served.process.pid)
    rss_before = rss_bytes(frontend)
    sock = _connect(served)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Huge: ")
    chunk, sent = b"z" * (1 << 20), 0
    started = time.monotonic()
    try:
        while sent < 200 << 20:  # up to 200 MiB, as the attack did; the server stops it long before
            sock.sendall(chunk)
            sent += len(chunk)
    except OSError:
        pass  # the server closed on us: what it sent first is still readable
    received, _ = _closed_after(sock)
    sock.close()
    assert received.startswith(b"HTTP/1.1 431"), received[:100]
    assert sent < 64 << 20 and time.monotonic() - started < 5.0, f"{sent >> 20} MiB accepted"
    assert rss_bytes(frontend) - rss_before < 32 << 20
    many = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
    many += b"".join(b"X-H%d: v\r\n" % i for i in range(500)) + b"\r\n"
    sock = _connect(served)
    sock.sendall(many)
    received, _ = _closed_after(sock)
    sock.close()
    assert received.startswith(b"HTTP/1.1 431"), received[:100]
    status, _, body = post_json(served.base_url, "/v1/completions", GREEDY)
    assert status == 200, body
