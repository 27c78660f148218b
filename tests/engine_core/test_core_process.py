"""The engine-core process's serving loop: sessions, routing, junk, silent clients, fatal errors.

An ``EngineCoreProcess`` with the fake executor is served from a thread of the test process
(milliseconds, no model), exactly as ``core_process.main`` runs and closes it; clients attach over
ipc://. Every engine and client started here is stopped by a fixture finalizer, even on failure.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from msgspec.structs import replace

from conveyor.engine_core import EngineCore
from conveyor.engine_core.client_registry import ClientRegistry
from conveyor.engine_core.core_process import EngineCoreProcess, StepWatchdog, find_address_problem
from conveyor.frontend.engine_client import core_client
from conveyor.frontend.engine_client.async_client import AsyncEngineClient
from conveyor.frontend.engine_client.session import EngineDeadError
from conveyor.protocol import EngineConfig, ModelRunnerOutput, ObservabilityConfig, SchedulerOutput
from conveyor.protocol.codec import CLIENT_TO_ENGINE, ENGINE_TO_CLIENT
from conveyor.protocol.messages import AddRequests, EngineDead, Heartbeat, Hello, Ready
from tests.engine_core.core_process_helpers import (
    BLOCK_SIZE,
    VOCAB,
    ClientPool,
    collect,
    expected_tokens,
    fake_config,
    request,
    wait_for,
)
from tests.fake_executor import FakeExecutor


@pytest.fixture
def make_client() -> Iterator[ClientPool]:
    with ClientPool() as pool:
        yield pool


def thread_cpu_ticks(native_id: int) -> int:
    """User + system CPU time of one thread of this process, in clock ticks (usually 10 ms)."""
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat(5)


class SlowFakeExecutor(FakeExecutor):
    """A step takes a few ms, like a real one: long requests stay in flight for a while."""

    def run_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        time.sleep(0.005)
        return super().run_step(scheduler_output)


class ThreadedEngine:
    """An EngineCoreProcess busy loop in a thread, run and closed the way ``main`` does it."""

    def __init__(
        self,
        executor: FakeExecutor,
        address: str,
        heartbeat_timeout_s: float,
        config: EngineConfig | None = None,
    ) -> None:
        self.core = EngineCore(config or fake_config(), executor)
        self.process = EngineCoreProcess(self.core, address, heartbeat_timeout_s)
        self.address = self.process.address
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        reason = "the engine was shut down"
        try:
            self.process.run()
        except Exception as exc:
            self.error = exc
            reason = f"engine core failed: {exc!r}"
        finally:
            self.process.close(reason, shutdown=self.error is None)

    def stop(self) -> None:
        self.process.stop()
        self.thread.join(5.0)
        assert not self.thread.is_alive(), "the busy loop did not stop"

    def join(self, timeout_s: float) -> None:
        self.thread.join(timeout_s)


@pytest.fixture
def make_engine(tmp_path: Path) -> Iterator:
    engines: list[ThreadedEngine] = []

    def make(
        executor: FakeExecutor | None = None,
        heartbeat_timeout_s: float = 10.0,
        config: EngineConfig | None = None,
    ):
        executor = executor or FakeExecutor(200, VOCAB, block_size=BLOCK_SIZE)
        address = f"ipc://{tmp_path / f'engine{len(engines)}.sock'}"
        engines.append(ThreadedEngine(executor, address, heartbeat_timeout_s, config))
        return engines[-1]

    yield make
    for engine in engines:
        engine.stop()


@pytest.fixture
def raw_socket(tmp_path: Path) -> Iterator:
    """Bare DEALER sockets that misbehave on purpose (never heartbeat, send junk)."""
    context = zmq.Context()
    sockets: list[zmq.Socket] = []

    def make(address: str) -> zmq.Socket:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.connect(address)
        sockets.append(sock)
        return sock

    yield make
    for sock in sockets:
        sock.close()
    context.term()


# ---------------------------------------------------------------- pieces


def test_client_registry_indexes_touches_and_expires():
    now = [100.0]
    registry = ClientRegistry(heartbeat_timeout_s=5.0, clock=lambda: now[0])
    a, b = registry.attach(b"a", "first"), registry.attach(b"b")
    assert (a.client_index, b.client_index) == (0, 1) and a.name == "first"
    assert registry.attach(b"a").client_index == 0, "a repeated Hello keeps the index"
    assert registry.identity_of(1) == b"b" and registry.touch(b"zz") is None
    now[0] = 104.0
    registry.touch(b"a")
    now[0] = 106.0
    assert [c.client_index for c in registry.detach_silent()] == [1]
    assert registry.identity_of(1) is None and registry.identities() == [b"a"]
    assert registry.detach(b"a").client_index == 0 and len(registry) == 0
    assert registry.attach(b"b").client_index == 2, "indexes are never reused"


def test_after_its_own_stall_the_registry_gives_every_client_a_whole_timeout():
    """An engine stopped for longer than the timeout heard nobody meanwhile: ``hear_all`` (the
    socket thread calls it after a gap in its own rounds) keeps it from dropping every client
    the moment it wakes."""
    now = [100.0]
    registry = ClientRegistry(heartbeat_timeout_s=5.0, clock=lambda: now[0])
    registry.attach(b"a")
    now[0] = 115.0  # woke after 15 s
    registry.hear_all()
    now[0] = 119.0
    assert registry.detach_silent() == []
    now[0] = 120.5
    assert [c.identity for c in registry.detach_silent()] == [b"a"], "then silence counts again"


def test_abort_client_aborts_only_that_clients_requests():
    core = EngineCore(fake_config(), FakeExecutor(100, VOCAB, block_size=BLOCK_SIZE))
    core.add_request(request("x", [1, 2, 3], 50), client_index=0)
    core.add_request(request("y", [1, 2, 3], 50), client_index=0)
    core.add_request(request("x", [4, 5, 6], 5), client_index=1)
    core.step()
    assert core.abort_client(0) == 2 and core.abort_client(0) == 0
    endings: dict[tuple[int, str], str] = {}
    while core.has_unfinished_requests():
        for client_index, outputs in core.step().items():
            for out in outputs.outputs:
                if out.finish_reason:
                    endings[(client_index, out.request_id)] = out.finish_reason
    assert endings == {(0, "x"): "abort", (0, "y"): "abort", (1, "x"): "length"}
    core.check_all_free()


@pytest.mark.parametrize(
    ("address", "allowed"),
    [
        ("ipc:///run/user/1000/engine.sock", True),
        ("tcp://127.0.0.1:5555", True),
        ("tcp://localhost:5555", True),
        ("tcp://[::1]:5555", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://10.1.2.3:5555", False),
        ("udp://127.0.0.1:5555", False),
    ],
)
def test_only_local_addresses_unless_remote_clients_are_allowed(address, allowed):
    assert (find_address_problem(address) is None) == allowed
    if address.startswith("tcp://"):
        # Allowed, but never unauthenticated: off loopback it takes CURVE keys as well
        # (tests/runtime/test_zmq_security.py).
        refused = find_address_problem(address, allow_remote_clients=True)
        assert (refused is None) == allowed and (allowed or "no CURVE keys" in refused)


def test_the_engine_process_refuses_a_public_address(tmp_path):
    config_file = tmp_path / "config.msgpack"
    config_file.write_bytes(msgspec.msgpack.encode(fake_config()))
    command = [
        sys.executable,
        "-m",
        "conveyor.entrypoints.engine",
        "--config-file",
        str(config_file),
    ]
    command += ["--address", "tcp://0.0.0.0:0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "reachable from other hosts" in result.stderr


# ---------------------------------------------------------------- a served engine (fake model)


def test_ready_then_two_clients_get_only_their_own_outputs(make_engine, make_client):
    engine = make_engine()
    first, second = make_client(engine.address), make_client(engine.address)
    assert {first.client_index, second.client_index} == {0, 1}
    assert first.config.cache.num_blocks == 200 and first.engine_pid == os.getpid()
    # The same request id from both clients: the engine keys requests by (client, id).
    first.add_request(request("same", [1, 2, 3], 8))
    second.add_request(request("same", [7, 8, 9, 10], 5))
    first.add_request(request("only-first", [3, 3], 4))
    got_first, got_second = collect(first), collect(second)
    assert got_first == {
        "same": (expected_tokens([1, 2, 3], 8), "length"),
        "only-first": (expected_tokens([3, 3], 4), "length"),
    }
    assert got_second == {"same": (expected_tokens([7, 8, 9, 10], 5), "length")}
    wait_for(lambda: not engine.core.has_unfinished_requests(), 2.0, "the engine to be idle")
    engine.core.check_all_free()


def test_junk_frames_are_dropped_and_the_engine_keeps_serving(make_engine, make_client, raw_socket):
    engine = make_engine()
    junk = raw_socket(engine.address)
    junk.send(b"\x00\xff garbage")
    junk.send_multipart([b"two", b"frames"])
    junk.send(msgspec.msgpack.encode({"not": "a message"}))
    junk.send(msgspec.msgpack.encode([3, 12345]))  # a Hello whose name is not a string
    junk.send(b"")
    junk.send(os.urandom(4096))
    # A heartbeat or a request from a socket that never said Hello is answered, not dropped:
    # that client's session is over (the engine is not).
    junk.send(CLIENT_TO_ENGINE.encode(Heartbeat()))
    junk.send(CLIENT_TO_ENGINE.encode(request("orphan", [1, 2])))
    for _ in range(2):
        reply = ENGINE_TO_CLIENT.decode(junk.recv())
        assert isinstance(reply, EngineDead) and reply.client_dropped
        assert "not attached" in reply.reason
    wait_for(lambda: engine.process.io.num_dropped_frames >= 6, 5.0, "junk to be counted")
    client = make_client(engine.address)
    client.add_request(request("fine", [5, 6, 7], 5))
    assert collect(client) == {"fine": (expected_tokens([5, 6, 7], 5), "length")}
    assert engine.error is None


def test_a_request_the_engine_cannot_read_gets_an_error_not_silence(make_engine, make_client):
    """A request whose id is readable but whose body is not (a float where the wire wants an
    integer) is answered with an error for that id, alone or in a batch, and the batch's other
    requests run."""
    engine = make_engine()
    client = make_client(engine.address)
    batch = [request("bad", [1, 2, 3], 4), request("good", [5, 6, 7], 5)]
    fields = msgspec.msgpack.decode(CLIENT_TO_ENGINE.encode(AddRequests(batch)))
    fields[1][0][3] = {"max_tokens": 4.0}  # the first request's sampling parameters
    single = msgspec.msgpack.decode(CLIENT_TO_ENGINE.encode(request("alone", [1, 2], 3)))
    single[3] = {"n": "three"}
    client._unfinished.update({"bad", "good", "alone"})  # before: the answers come at once
    for frame in (fields, single):
        client._sender.send(msgspec.msgpack.encode(frame))
    got = collect(client)
    assert got == {
        "good": (expected_tokens([5, 6, 7], 5), "length"),
        "bad": ([], "error"),
        "alone": ([], "error"),
    }
    assert engine.process.io.num_dropped_frames == 2 and engine.error is None


def test_a_silent_client_is_dropped_and_its_requests_aborted(make_engine, make_client, raw_socket):
    executor = SlowFakeExecutor(200, VOCAB, block_size=BLOCK_SIZE)
    engine = make_engine(executor, heartbeat_timeout_s=1.0)
    silent = raw_socket(engine.address)
    silent.send(CLIENT_TO_ENGINE.encode(Hello("silent")))
    assert isinstance(ENGINE_TO_CLIENT.decode(silent.recv()), Ready)
    # 400 steps of over 5 ms each: far longer than the 1 s the engine waits for a heartbeat.
    silent.send(CLIENT_TO_ENGINE.encode(request("long", [1, 2, 3], 400)))
    alive = make_client(engine.address, heartbeat_interval_s=0.1)
    alive.add_request(request("kept", [4, 4, 4], 300))
    # The heartbeating client outlives the timeout and gets every token.
    assert collect(alive) == {"kept": (expected_tokens([4, 4, 4], 300), "length")}
    wait_for(lambda: not engine.core.has_unfinished_requests(), 2.0, "the abort")
    engine.core.check_all_free()
    assert alive.stats.num_running == 0 and alive.stats.kv_cache_usage == 0.0
    # Once dropped, the silent client hears nothing more of "long" and is told it is detached.
    silent.send(CLIENT_TO_ENGINE.encode(request("late", [1])))
    outputs = []
    while not isinstance(message := ENGINE_TO_CLIENT.decode(silent.recv()), EngineDead):
        outputs += message.outputs.outputs
    assert message.client_dropped and "missing heartbeats for over 1 s" in message.reason
    long_tokens = [t for o in outputs if o.request_id == "long" for t in o.new_token_ids]
    assert 0 < len(long_tokens) < 400
    assert all(o.finish_reason is None for o in outputs if o.request_id == "long")
    assert "late" not in {o.request_id for o in outputs}


def test_a_dropped_async_client_learns_its_session_is_lost(make_engine, make_client, monkeypatch):
    """A client that stalled past the heartbeat timeout (as a SIGSTOPped frontend does) hears,
    at its next heartbeat, that it was dropped: it is not served, while the engine serves on."""
    engine = make_engine(heartbeat_timeout_s=1.0)
    alive = make_client(engine.address, heartbeat_interval_s=0.1)
    # The stall: this client keeps the interval it was given, whatever the engine's timeout.
    monkeypatch.setattr(core_client, "heartbeat_interval", lambda requested, timeout: requested)

    async def scenario() -> None:
        # Heartbeats 1.5 s apart: the engine drops the client before the second one.
        client = await AsyncEngineClient.start(address=engine.address, heartbeat_interval_s=1.5)
        try:
            assert not client.session_lost
            deadline = time.monotonic() + 5.0
            while client.dead_reason is None:
                assert time.monotonic() < deadline, "the dropped client was never told"
                await asyncio.sleep(0.05)
            assert client.session_lost and "missing heartbeats" in client.dead_reason
            with pytest.raises(EngineDeadError, match="not attached"):
                await client.add_request(request("late", [1, 2], 3))
        finally:
            await client.shutdown()

    asyncio.run(scenario())
    alive.add_request(request("served", [3, 4], 3))
    assert collect(alive) == {"served": (expected_tokens([3, 4], 3), "length")}
    assert engine.error is None


def test_goodbye_aborts_the_clients_requests_at_once(make_engine, make_client):
    engine = make_engine(SlowFakeExecutor(200, VOCAB, block_size=BLOCK_SIZE))
    leaving, staying = make_client(engine.address), make_client(engine.address)
    leaving.add_request(request("a", [1, 2], 400))
    leaving.add_request(request("b", [2, 1], 400))
    wait_for(lambda: engine.core.scheduler.num_running == 2, 2.0, "both to run")
    leaving.shutdown()
    wait_for(lambda: not engine.core.has_unfinished_requests(), 2.0, "the aborts")
    engine.core.check_all_free()
    staying.add_request(request("c", [9], 3))
    assert collect(staying) == {"c": (expected_tokens([9], 3), "length")}


class FailingExecutor(FakeExecutor):
    def run_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if scheduler_output.step_id >= 3:
            raise RuntimeError("injected step failure")
        return super().run_step(scheduler_output)


def test_a_failing_step_sends_engine_dead_to_every_client(make_engine, make_client):
    engine = make_engine(FailingExecutor(200, VOCAB, block_size=BLOCK_SIZE))
    watcher, sender = make_client(engine.address), make_client(engine.address)
    sender.add_request(request("doomed", [1, 2, 3], 50))
    with pytest.raises(EngineDeadError, match="injected step failure"):
        collect(sender)
    with pytest.raises(EngineDeadError, match="injected step failure"):
        watcher.get_outputs(5.0)  # a client with no request hears it too
    assert not sender.has_unfinished_requests()
    with pytest.raises(EngineDeadError):
        sender.add_request(request("after", [1]))
    engine.join(5.0)
    assert isinstance(engine.error, RuntimeError)


class DyingWorkersExecutor(FakeExecutor):
    """Workers that die while the engine is idle: only ``check_health`` can tell."""

    dead = False

    def check_health(self) -> None:
        if self.dead:
            raise RuntimeError("worker rank 0 was killed by SIGKILL")


def test_an_idle_engine_blocks_and_still_notices_dead_workers(make_engine, make_client):
    executor = DyingWorkersExecutor(200, VOCAB, block_size=BLOCK_SIZE)
    engine = make_engine(executor)
    client = make_client(engine.address)
    client.add_request(request("r", [1, 2], 3))
    collect(client)
    # Idle: the busy loop waits on its queue and the socket thread on its poller; no spinning.
    threads = [engine.thread.native_id, engine.process.io._thread.native_id]
    before = sum(thread_cpu_ticks(tid) for tid in threads)
    time.sleep(1.0)
    used = sum(thread_cpu_ticks(tid) for tid in threads) - before
    assert used <= 5, f"the idle engine's threads used {used} ticks (10 ms) of CPU in 1 s"
    executor.dead = True
    with pytest.raises(EngineDeadError, match="killed by SIGKILL"):
        client.get_outputs(5.0)


def test_debug_queries_report_what_is_left_only_when_enabled(make_engine, make_client):
    plain = make_client(make_engine().address)
    assert "disabled" in plain.ask_all_free()
    config = replace(fake_config(), observability=ObservabilityConfig(debug_queries=True))
    engine = make_engine(SlowFakeExecutor(200, VOCAB, block_size=BLOCK_SIZE), config=config)
    client = make_client(engine.address)
    assert client.ask_all_free() == ""
    client.add_request(request("long", [1, 2, 3, 4, 5, 6], max_tokens=400))
    assert client.get_outputs(5.0) is not None
    assert "1 running" in client.ask_all_free()
    client.abort(["long"])
    client.check_all_free()  # waits for the abort's final output, then asks until empty
    assert engine.core.scheduler.kv_cache_manager.num_free_blocks == 199


def test_the_watchdog_fires_once_for_a_step_over_its_timeout():
    fired: list[str] = []
    watchdog = StepWatchdog(0.2, fired.append)
    watchdog.start()
    watchdog.step_started()
    watchdog.step_ended()  # a quick step: nothing
    time.sleep(0.4)
    assert fired == []
    watchdog.step_started()
    wait_for(lambda: fired, 2.0, "the watchdog")
    time.sleep(0.3)
    assert len(fired) == 1 and "hung" in fired[0]


def test_a_request_that_makes_the_engine_raise_fails_alone(make_engine, make_client, monkeypatch):
    monkeypatch.setenv("CONVEYOR_ENGINE_FAULT_INJECT", "raise@request=poison")
    engine = make_engine()
    client = make_client(engine.address)
    client.add_request(request("before", [1, 2, 3], max_tokens=5))
    client.add_request(request("poison", [4, 5, 6], max_tokens=5))
    client.add_request(request("after", [7, 8, 9], max_tokens=5))
    results = collect(client)
    assert results["poison"] == ([], "error")
    assert results["before"] == (expected_tokens([1, 2, 3], 5), "length")
    assert results["after"] == (expected_tokens([7, 8, 9], 5), "length")
    assert engine.thread.is_alive() and engine.error is None
    engine.core.check_all_free()


def test_every_client_gets_the_engines_stats_outputs_or_not(make_engine, make_client):
    engine = make_engine(SlowFakeExecutor(200, VOCAB, block_size=BLOCK_SIZE))
    busy, idle = make_client(engine.address), make_client(engine.address)
    busy.add_request(request("a", [1, 2, 3], 250))  # over a second of 5 ms steps
    wait_for(lambda: idle.stats is not None and idle.stats.num_running == 1, 3.0, "a broadcast")
    assert collect(busy) == {"a": (expected_tokens([1, 2, 3], 250), "length")}
    # The idle client hears that the engine went idle, and never an output.
    wait_for(lambda: idle.stats.num_running == 0, 2.0, "the idle broadcast")
    assert idle.stats.num_steps == busy.stats.num_steps == 250
    assert idle.get_outputs(0.2) is None
    # A client that attaches now gets the latest stats right after Ready.
    late = make_client(engine.address)
    wait_for(lambda: late.stats is not None, 2.0, "stats after Ready")
    assert late.stats.num_generation_tokens == 249


def test_a_stopped_engine_says_it_was_shut_down_not_that_it_failed(
    make_engine, raw_socket, make_client, caplog
):
    engine = make_engine()
    sock = raw_socket(engine.address)
    sock.send(CLIENT_TO_ENGINE.encode(Hello("raw")))
    assert isinstance(ENGINE_TO_CLIENT.decode(sock.recv()), Ready)
    client = make_client(engine.address)
    engine.stop()
    while not isinstance(message := ENGINE_TO_CLIENT.decode(sock.recv()), EngineDead):
        pass
    assert message.shutdown and message.reason == "the engine was shut down"
    with pytest.raises(EngineDeadError, match="shut down"):
        client.get_outputs(5.0)
    # An attached client warns that it can no longer serve; only a failure is an error.
    records = [r for r in caplog.records if r.name == "conveyor.frontend.engine_client.core_client"]
    assert [r.levelname for r in records] == ["WARNING"]
