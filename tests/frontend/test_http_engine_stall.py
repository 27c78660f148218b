"""Row 28: the engine stalls past the heartbeat limits (SIGSTOP: what a paused VM or a swap storm
does to it) with streams open, then resumes. The server must serve again within seconds, or exit
non-zero; never stay up refusing everything.

Short limits stand in for the defaults, to keep the suite fast: ``--heartbeat-timeout-s 3`` (the
engine's patience with a silent frontend) and ``--engine-silence-timeout-s 3`` (the frontend's
with a silent engine) make a 6 s stop "past the limit" and a 12 s one "long", where the default
10 s limits need 15 s and 60 s (checked by hand; docs/reliability.md). One engine (stopped 6 s and
12 s) and two (both stopped 6 s), each a server of its own; then one whose engine never resumes,
with ``--engine-lost-timeout-s 2``: the server exits 1 and leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.frontend.http_helpers import (
    ServedHttp,
    frontend_pids,
    get,
    post_json,
    read_events,
    read_to_end,
    send_completion,
    start_served_http,
    stream_payloads,
    wait_for,
)
from tests.process_tree import descendants, kill_all, wait_until_gone

# Two engines in one test: with the other modules that start several, never side by side (on a
# 2-core machine they starve each other's heartbeats).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("multi-engine")]

LIMIT_S = 3.0
LIMITS = ["--heartbeat-timeout-s", str(LIMIT_S), "--engine-silence-timeout-s", str(LIMIT_S)]
PROMPT = "def main():"


def _served(model_dir: Path, log: Path, extra: list[str]) -> Iterator[ServedHttp]:
    served = start_served_http(model_dir, log, [*LIMITS, *extra])
    try:
        yield served
    finally:
        for pid in [served.engine_pid, *served.dp_engine_pids.values()]:
            if pid:
                with_suppressed_lookup(os.kill, pid, signal.SIGCONT)
        served.stop()


def with_suppressed_lookup(function, *args) -> None:
    with contextlib.suppress(ProcessLookupError):
        function(*args)


@pytest.fixture(scope="module")
def served_one(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    yield from _served(tiny_model_dir, tmp_path_factory.mktemp("stall-1") / "serve.log", [])


@pytest.fixture(scope="module")
def served_two(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    log = tmp_path_factory.mktemp("stall-2") / "serve.log"
    yield from _served(tiny_model_dir, log, ["--data-parallel-size", "2"])


def _text(served: ServedHttp) -> str:
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    status, _, answer = post_json(served.base_url, "/v1/completions", body)
    assert status == 200, answer
    return answer["choices"][0]["text"]


class OpenStreams:
    """Streams that run past any stall of the test, each read to its end on a thread."""

    def __init__(self, served: ServedHttp, count: int) -> None:
        long = {"max_tokens": 3000, "ignore_eos": True, "stream": True, "temperature": 0}
        self.socks: list[socket.socket] = []
        for i in range(count):
            sock = send_completion(served.base_url, {**long, "prompt": f"x = {i}"})
            read_events(sock, 2)  # streaming before the stall
            sock.settimeout(60.0)
            self.socks.append(sock)
        self.raw: dict[int, bytes] = {}
        self._threads = [
            threading.Thread(target=self._read, args=(i,), daemon=True) for i in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def _read(self, index: int) -> None:
        self.raw[index] = read_to_end(self.socks[index])

    def errors(self, timeout_s: float) -> list[str]:
        """Each stream's error message; every stream must end, each with an error event."""
        for thread in self._threads:
            thread.join(timeout_s)
        for sock in self.socks:
            sock.close()
        messages = []
        for index in range(len(self.socks)):
            raw = self.raw.get(index, b"")
            assert raw.endswith(b"data: [DONE]\n\n") or b"data: [DONE]" in raw, raw[-300:]
            events = [p["error"]["message"] for p in stream_payloads(raw) if "error" in p]
            assert events, f"stream {index} ended without an error event: {raw[-300:]!r}"
            messages += events
        return messages


def _stall(served: ServedHttp, engine_pids: list[int], stop_s: float) -> None:
    """Stop the engines for ``stop_s`` under two streams and check everything the stall must
    do: 503s that say why while it lasts, open streams ended with an error, then (the engines
    resumed) /health 200 within seconds and exact text from the same process, no restart."""
    expected = _text(served)
    frontends = frontend_pids(served.process.pid)
    streams = OpenStreams(served, 2)
    for pid in engine_pids:
        os.kill(pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        unavailable = wait_for(
            lambda: (health := get(served.base_url, "/health"))[0] == 503 and health[1],
            LIMIT_S + 5.0,
            0.1,
        )
        assert unavailable, "/health stayed 200 past the silence limit"
        assert "has not been heard from for" in unavailable, unavailable
        assert "attaching again as soon as" in unavailable, unavailable
        status, headers, body = post_json(served.base_url, "/v1/completions", {"prompt": "x"})
        assert status == 503 and int(headers["retry-after"]) > 0, body
        assert "has not been heard from for" in body["error"]["message"], body
        assert time.monotonic() - stopped_at < stop_s, "the stop must outlast the checks"
        time.sleep(stop_s - (time.monotonic() - stopped_at))
    finally:
        for pid in engine_pids:
            os.kill(pid, signal.SIGCONT)
    resumed_at = time.monotonic()
    # The stall's own streams end with an error (they may not be resumed); none hangs.
    for message in streams.errors(timeout_s=30.0):
        assert "answered no heartbeat" in message, message
    assert wait_for(lambda: get(served.base_url, "/health")[0] == 200, 10.0, 0.05)
    assert time.monotonic() - resumed_at < 5.0, "not serving again within seconds"
    assert _text(served) == expected
    assert frontend_pids(served.process.pid) == frontends, "a frontend was restarted"
    assert served.process.poll() is None


@pytest.mark.parametrize("stop_s", [2 * LIMIT_S, 4 * LIMIT_S])
def test_one_engine_stalled_past_the_limit_serves_again_when_it_resumes(served_one, stop_s):
    goodbye = re.compile(r"client \d+ gone \(goodbye\): aborted 2 requests")
    before = served_one.log.read_text()
    _stall(served_one, [served_one.engine_pid], stop_s)
    log = served_one.log.read_text()
    assert log.count("engine 0 serves again") == before.count("engine 0 serves again") + 1
    # The engine, awake, did not drop the frontend for the engine's own stall (that would say
    # "gone (heartbeat timeout)"): the frontend's Goodbye, sent when it gave up on the engine,
    # ended that session and aborted the stall's requests at once.
    assert log.count("did not run for") == before.count("did not run for") + 1
    assert len(goodbye.findall(log)) == len(goodbye.findall(before)) + 1, log[len(before) :]


def test_two_engines_stalled_past_the_limit_serve_again_when_they_resume(served_two):
    engines = [served_two.dp_engine_pids[rank] for rank in (0, 1)]
    _stall(served_two, engines, 2 * LIMIT_S)
    log = served_two.log.read_text()
    assert "engine 0 serves again" in log and "engine 1 serves again" in log


@pytest.fixture
def served_lost(tiny_model_dir: Path, tmp_path: Path) -> Iterator[ServedHttp]:
    extra = ["--engine-lost-timeout-s", "2", "--stop-timeout-s", "2"]
    yield from _served(tiny_model_dir, tmp_path / "serve.log", extra)


def test_an_engine_that_never_resumes_ends_in_a_non_zero_exit(served_lost):
    """Stopped for good: after the silence limit and then the lost limit without an answer, the
    frontend exits 4 and the supervisor stops everything with exit 1, so a process manager can
    restart the server."""
    served = served_lost
    children = descendants(served.process.pid)
    os.kill(served.engine_pid, signal.SIGSTOP)
    try:
        assert served.process.wait(LIMIT_S + 2.0 + 20.0) == 1
    finally:
        with_suppressed_lookup(os.kill, served.engine_pid, signal.SIGCONT)
        kill_all(children)
    assert wait_until_gone(children, 10.0) == [], "the supervisor left children behind"
    log = served.log.read_text()
    assert "no engine has answered for" in log
    assert re.search(r"frontend-0 \(pid \d+\) exited with code 4: no engine answered it", log)
