"""Faults around the HTTP frontends of a real server: an abort storm, a SIGKILLed frontend and a
stalled (SIGSTOPped) one.

One ``conveyor serve --frontends 2 --enable-debug-queries`` per module, with a 4 s heartbeat
timeout (so a dead frontend's requests are aborted soon) and a restart budget of one. The engine's
own block accounting (the debug query, asked by an ``MPEngineClient`` attached to the engine's
address) says whether every KV block is free again. The kill test kills frontends (the second
death spends the restart budget and stops the server), so it must be the last test of that
server; the stall test after it runs a server of its own.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conveyor.engine_core.core_process import ENGINE_FAULT_ENV
from conveyor.frontend.engine_client import MPEngineClient
from tests.frontend.http_helpers import (
    ServedHttp,
    accepting_frontend,
    frontend_pid_of,
    frontend_pids,
    get,
    post_json,
    read_events,
    read_to_end,
    send_completion,
    start_served_http,
    stream_payloads,
    stream_text,
    wait_for,
)
from tests.multiproc_helpers import listening_tcp_addresses
from tests.process_tree import descendants, kill_all, wait_until_gone

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("http-faults")]

HEARTBEAT_TIMEOUT_S = 4.0
PROMPTS = ["def main():", "import os\n", "class Foo:", "x = [1, 2, 3]"]
# Tokens, and 2 choices each: two such streams run for 8 s or more even on a quiet machine (3000
# tokens of one choice took about 5 s), well past the heartbeat timeout that aborts them.
LONG = 4000
POISON_SEED = 424242


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedHttp]:
    log = tmp_path_factory.mktemp("faults") / "serve.log"
    extra = ["--frontends", "2", "--enable-debug-queries", "--frontend-max-restarts", "1"]
    extra += ["--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S)]
    # Row 13: a request with this seed makes the engine process raise while adding it.
    env = {ENGINE_FAULT_ENV: f"raise@seed={POISON_SEED}"}
    served = start_served_http(tiny_model_dir, log, extra, env=env)
    try:
        yield served
    finally:
        served.stop()


def _greedy(prompt: str, max_tokens: int, stream: bool = False) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}  # fmt: skip


def _whole_text(served: ServedHttp, prompt: str, max_tokens: int) -> str:
    status, _, body = post_json(served.base_url, "/v1/completions", _greedy(prompt, max_tokens))
    assert status == 200, body
    return body["choices"][0]["text"]


def _check_all_free(served: ServedHttp, timeout_s: float) -> None:
    """The engine's own accounting: no request anywhere, every KV block free, ref count 0."""
    client = MPEngineClient(address=served.engine_address, ready_timeout_s=10.0)
    try:
        client.check_all_free(timeout_s)
    finally:
        client.shutdown()


def test_every_listening_socket_is_loopback(served):
    """Row 16: the frontends listen on 127.0.0.1 only (on the socket the supervisor bound, which
    it holds too); the engine and workers on no TCP port at all (the engine on ipc://; gloo binds
    loopback only with tensor parallelism)."""
    assert served.engine_address.startswith("ipc://")
    holders = {served.process.pid, *frontend_pids(served.process.pid)}
    for pid in [served.process.pid, *descendants(served.process.pid)]:
        addresses = listening_tcp_addresses(pid)
        if pid in holders:
            assert addresses and set(addresses) == {f"127.0.0.1:{served.port}"}, (pid, addresses)
        else:
            assert addresses == [], (pid, addresses)


def test_an_abort_storm_leaves_survivors_exact_and_every_block_free(served):
    """Row 3: 16 streams, half hung up at random moments; the others get exactly their text."""
    max_tokens = 40
    expected = {p: _whole_text(served, p, max_tokens) for p in PROMPTS}
    rng = random.Random(7)
    socks = [send_completion(served.base_url, _greedy(PROMPTS[i % 4], max_tokens, True))
             for i in range(16)]  # fmt: skip
    cancelled = set(rng.sample(range(16), 8))
    received = {i: read_events(sock, 1) for i, sock in enumerate(socks)}
    try:
        for i in rng.sample(sorted(cancelled), len(cancelled)):
            received[i] = read_events(socks[i], rng.randint(1, 6))
            socks[i].close()
        for i in set(range(16)) - cancelled:
            text, finish_reason = stream_text(read_to_end(socks[i], received[i]))
            assert (text, finish_reason) == (expected[PROMPTS[i % 4]], "length"), i
    finally:
        for sock in socks:
            sock.close()
    _check_all_free(served, timeout_s=10.0)


def test_a_request_that_makes_the_engine_raise_fails_alone_over_http(served):
    """Row 13 over HTTP: the poisoned request (whole: a 500 with an OpenAI error body; streamed:
    an error event) fails while the others in flight get exactly their text."""
    max_tokens = 30
    expected = {p: _whole_text(served, p, max_tokens) for p in PROMPTS[:2]}
    socks = [send_completion(served.base_url, _greedy(p, max_tokens, True)) for p in PROMPTS[:2]]
    poison = {**_greedy(PROMPTS[2], max_tokens), "seed": POISON_SEED}
    try:
        received = [read_events(sock, 1) for sock in socks]
        status, _, body = post_json(served.base_url, "/v1/completions", poison)
        assert status == 500 and body["error"]["type"] == "InternalServerError", body
        assert "injected fault" in body["error"]["message"]
        poisoned_stream = send_completion(served.base_url, {**poison, "stream": True})
        events = stream_payloads(read_to_end(poisoned_stream))
        poisoned_stream.close()
        assert events and "injected fault" in events[-1]["error"]["message"], events
        assert not any(e.get("choices") for e in events)
        for sock, prompt, start in zip(socks, PROMPTS[:2], received):
            assert stream_text(read_to_end(sock, start)) == (expected[prompt], "length")
    finally:
        for sock in socks:
            sock.close()
    assert _whole_text(served, PROMPTS[3], 5)  # the engine still serves
    _check_all_free(served, timeout_s=10.0)


def _open_streams_on(
    served: ServedHttp, bodies: dict[int, dict], num_each: int
) -> dict[int, list[socket.socket]]:
    """``num_each`` streams accepted by each frontend pid in ``bodies``, each sent its body."""
    on: dict[int, list[socket.socket]] = {pid: [] for pid in bodies}
    for _ in range(60):
        if all(len(socks) == num_each for socks in on.values()):
            return on
        sock = socket.create_connection(("127.0.0.1", served.port), timeout=30)
        pid = frontend_pid_of(sock, list(bodies))
        if len(on[pid]) == num_each:
            sock.close()
            continue
        on[pid].append(send_completion(served.base_url, bodies[pid], sock=sock))
    raise AssertionError(f"the kernel did not spread 60 connections over both frontends: {on}")


def test_a_killed_frontend_is_restarted_and_the_others_are_unaffected(served):
    """Row 8, and the restart budget: the second death in a minute stops everything."""
    victim, survivor = frontend_pids(served.process.pid)
    short = 120
    expected = _whole_text(served, PROMPTS[0], short)
    long = {**_greedy(PROMPTS[1], LONG, True), "n": 2}
    bodies = {victim: long, survivor: _greedy(PROMPTS[0], short, True)}
    on = _open_streams_on(served, bodies, num_each=2)
    engine = MPEngineClient(address=served.engine_address, ready_timeout_s=10.0)
    children = descendants(served.process.pid)
    try:
        received = {sock: read_events(sock, 1) for socks in on.values() for sock in socks}
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        for sock in on[survivor]:
            assert stream_text(read_to_end(sock, received[sock])) == (expected, "length")
        for sock in on[victim]:
            assert b"data: [DONE]" not in read_to_end(sock, received[sock])
        # The engine aborts the dead client's requests once its heartbeat is overdue: long
        # before the 4000 tokens each would take.
        engine.check_all_free(HEARTBEAT_TIMEOUT_S + 10.0)
        assert time.monotonic() - killed_at < HEARTBEAT_TIMEOUT_S + 10.0
        assert served.process.poll() is None, "the supervisor must keep serving"
        log = served.log.read_text()
        assert re.search(rf"WARNING conveyor.entrypoints.supervisor: frontend-\d \(pid {victim}\) exited with code -9; "
                         r"restarting it", log)  # fmt: skip
        assert re.search(r"client \d+ gone \(heartbeat timeout\): aborted 4 requests", log)

        def replaced() -> list[int]:
            pids = frontend_pids(served.process.pid)
            return pids if len(pids) == 2 and victim not in pids else []

        replacement = next(p for p in wait_for(replaced, 30.0, 0.1) if p != survivor)
        assert wait_for(lambda: served.log.read_text().count("serves again") == 1, 30.0, 0.1)
        pids = [survivor, replacement]
        assert wait_for(lambda: accepting_frontend(served.port, pids) == replacement, 10.0), (
            "the replacement does not serve the port"
        )
        assert _whole_text(served, PROMPTS[0], short) == expected

        # A second death within the window is one more than --frontend-max-restarts 1.
        os.kill(replacement, signal.SIGKILL)
        assert served.process.wait(30.0) == 1
        assert "more than 1 frontend restarts within 60 s; stopping everything" in (
            served.log.read_text()
        )
        assert wait_until_gone(children, 15.0) == [], "the supervisor left children behind"
    finally:
        engine.shutdown()
        for socks in on.values():
            for sock in socks:
                sock.close()
        kill_all(children)


STALL_HEARTBEAT_TIMEOUT_S = 3.0  # the least conveyor serve allows


@pytest.fixture
def served_alone(tiny_model_dir: Path, tmp_path: Path) -> Iterator[ServedHttp]:
    """One frontend and a short heartbeat timeout, for a test that stalls that frontend."""
    extra = ["--frontends", "1", "--heartbeat-timeout-s", str(STALL_HEARTBEAT_TIMEOUT_S)]
    served = start_served_http(tiny_model_dir, tmp_path / "serve.log", extra)
    try:
        yield served
    finally:
        served.stop()


def test_a_frontend_dropped_for_stalling_attaches_again(served_alone):
    """A frontend stalled past the heartbeat timeout is dropped by the engine. Running again, it
    must not answer every request with an error while /health says 200: the engine tells it its
    session is over, and it attaches again, as to an engine that went down (row 28's one
    mechanism), serving the same tokens from the same process; nothing is restarted."""
    served = served_alone
    (stalled,) = frontend_pids(served.process.pid)
    expected = _whole_text(served, PROMPTS[0], 8)
    os.kill(stalled, signal.SIGSTOP)
    try:
        dropped = wait_for(
            lambda: "silent for over 3.0 s" in served.log.read_text(),
            STALL_HEARTBEAT_TIMEOUT_S + 15.0,
            0.1,
        )
    finally:
        os.kill(stalled, signal.SIGCONT)
    assert dropped, "the engine did not drop the stalled frontend"
    assert wait_for(lambda: "engine 0 serves again" in served.log.read_text(), 15.0, 0.1)
    assert "engine session lost: this client is not attached" in served.log.read_text()
    assert get(served.base_url, "/health")[0] == 200
    assert _whole_text(served, PROMPTS[0], 8) == expected
    assert frontend_pids(served.process.pid) == [stalled], "the frontend was replaced"
    assert "restarting it" not in served.log.read_text()
    assert served.process.poll() is None, "the supervisor must keep serving"
