"""Engine clients through real engine-core processes on the tiny model.

The sync client (``MPEngineClient``, what ``LLM`` uses by default) and the asyncio client
(``AsyncEngineClient``) must give the in-process greedy tokens, share one engine without mixing
outputs, end streams on abort, and turn a dead engine into ``EngineDeadError`` within seconds.
Every engine process started here is stopped by a fixture finalizer, even when a test fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvloop

from conveyor.frontend import LLM
from conveyor.frontend.engine_args import EngineArgs
from conveyor.frontend.engine_client import (
    AsyncEngineClient,
    EngineDeadError,
    EngineStartError,
    MPEngineClient,
    async_client,
)
from conveyor.frontend.engine_client.core_client import SILENCE_HEARTBEATS, heartbeat_interval
from conveyor.frontend.engine_client.engine_process import EngineProcess
from conveyor.protocol import EngineCoreRequest, SamplingParams
from tests.process_tree import descendants, kill_all, wait_until_gone

SMALL_KV = 16 << 20
NUM_TOKENS = 12
PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], [42] * 20, [7, 1, 7, 1, 7, 1, 7]]
LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def greedy(request_id: str, prompt: list[int], max_tokens: int = NUM_TOKENS) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(request_id, prompt, params, time.time())


def run_async(coroutine, loop: str = "asyncio"):
    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        return runner.run(coroutine)


def collect(client: MPEngineClient, timeout_s: float = 30.0) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    deadline = time.monotonic() + timeout_s
    while client.has_unfinished_requests():
        assert time.monotonic() < deadline, "outputs did not arrive in time"
        outputs = client.get_outputs(0.5)
        for out in outputs.outputs if outputs else []:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> list[list[int]]:
    """Greedy tokens of each prompt from the in-process engine."""
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    with LLM(str(tiny_model_dir), engine="inprocess", kv_cache_memory=SMALL_KV) as llm:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Iterator[LLM]:
    """The default LLM: its engine is a process other clients can attach to."""
    with LLM(str(tiny_model_dir), kv_cache_memory=SMALL_KV) as llm:
        yield llm


@pytest.fixture
def clients() -> Iterator[list]:
    """Sync clients to shut down at the end, whatever happened."""
    made: list[MPEngineClient] = []
    yield made
    for client in made:
        client.shutdown()


@contextlib.contextmanager
def running_engine(
    model_dir: Path, executor_backend: str, heartbeat_timeout_s: float | None = None
) -> Iterator[EngineProcess]:
    """A dedicated engine process, ready; stopped with every process it started."""
    config = EngineArgs(model=str(model_dir), kv_cache_memory=SMALL_KV).create_engine_config()
    engine = EngineProcess(config, executor_backend, heartbeat_timeout_s).start()
    children: list[int] = []
    try:
        engine.wait_ready(60.0)
        children += descendants(engine.pid)
        yield engine
    finally:
        engine.stop(5.0)
        kill_all(children)


@pytest.fixture
def engine_process(tiny_model_dir: Path) -> Iterator[EngineProcess]:
    """A dedicated engine (with worker processes) for a test that kills it."""
    with running_engine(tiny_model_dir, "mp") as engine:
        yield engine


def test_llm_runs_an_engine_process_and_matches_the_in_process_tokens(llm, reference):
    assert isinstance(llm._engine, MPEngineClient)
    assert llm._engine.config.cache.num_blocks > 1
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    llm.check_all_free()


def test_two_clients_on_one_engine_each_get_exactly_their_own(llm, reference, clients):
    address = llm._engine.address
    first = MPEngineClient(address=address, client_name="first")
    clients.append(first)
    second = MPEngineClient(address=address, client_name="second")
    clients.append(second)
    assert len({first.client_index, second.client_index, llm._engine.client_index}) == 3
    # Interleaved, and the same request id on both clients.
    first.add_request(greedy("same", PROMPTS[0]))
    second.add_request(greedy("same", PROMPTS[1]))
    first.add_request(greedy("other", PROMPTS[2]))
    second.add_request(greedy("mine", PROMPTS[3]))
    assert collect(first) == {"same": reference[0], "other": reference[2]}
    assert collect(second) == {"same": reference[1], "mine": reference[3]}
    # Stats arrive with outputs: a last request brings fresh ones, taken after both finished.
    first.add_request(greedy("probe", PROMPTS[0], 1))
    collect(first)
    first.check_all_free()


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_async_streams_match_and_abort_or_close_ends_them(llm, reference, loop):
    async def scenario() -> None:
        client = await AsyncEngineClient.start(address=llm._engine.address, client_name=loop)
        try:

            async def tokens_of(request_id: str, prompt: list[int]) -> list[int]:
                stream = await client.add_request(greedy(request_id, prompt))
                return [t async for out in stream for t in out.new_token_ids]

            results = await asyncio.gather(*(tokens_of(f"r{i}", p) for i, p in enumerate(PROMPTS)))
            assert results == reference
            # An abort ends the stream with finish_reason "abort".
            aborted = await client.add_request(greedy("aborted", PROMPTS[0], 4000))
            first = await anext(aborted)
            assert first.finish_reason is None
            await client.abort(["aborted"])
            rest = [out async for out in aborted]
            assert rest[-1].finish_reason == "abort"
            # A consumer that walks away (closes its stream) aborts the request too.
            walked = await client.add_request(greedy("walked", PROMPTS[1], 4000))
            await anext(walked)
            await walked.aclose()
            with pytest.raises(ValueError, match="already in flight"):
                await client.add_request(greedy("dup", PROMPTS[0], 4000))
                await client.add_request(greedy("dup", PROMPTS[0], 4000))
            await client.abort(["dup"])
            deadline = time.monotonic() + 10.0
            while client.stats.num_running or client.stats.num_waiting:
                assert time.monotonic() < deadline, "the walked-away request still runs"
                probe = await client.add_request(greedy(f"probe-{time.monotonic()}", [1], 1))
                [_ async for _ in probe]
            assert client.stats.kv_cache_usage == 0.0
        finally:
            await client.shutdown()

    run_async(scenario(), loop)


def test_add_request_cannot_be_cancelled_half_way(llm):
    """A caller cancelled around ``add_request`` (its HTTP client left at that moment) leaves
    either nothing in the engine, or a stream registered for it: sending never waits, so there
    is no point inside add_request where a cancellation could leave the request unowned."""

    async def scenario() -> None:
        client = await AsyncEngineClient.start(address=llm._engine.address)
        try:
            adding = asyncio.create_task(client.add_request(greedy("cut", PROMPTS[0], 4000)))
            adding.cancel()  # before it ran: nothing may have been sent
            with pytest.raises(asyncio.CancelledError):
                await adding
            assert client._streams == {}
            await asyncio.sleep(0.2)
            assert await client.ask_all_free() == ""
            stream = await client.add_request(greedy("kept", PROMPTS[0], 4000))
            assert set(client._streams) == {"kept"}
            await stream.aclose()  # never iterated: closing it aborts nothing it had not begun
            await client.abort(["kept"])
            deadline = time.monotonic() + 3.0
            while problem := await client.ask_all_free():
                assert time.monotonic() < deadline, f"the aborted request was left: {problem}"
                await asyncio.sleep(0.05)
        finally:
            await client.shutdown()

    run_async(scenario())


@pytest.mark.slow
def test_killing_the_engine_fails_every_open_request_within_seconds(engine_process, clients):
    sync_client = MPEngineClient(address=engine_process.address)
    clients.append(sync_client)
    sync_client.add_request(greedy("sync-open", PROMPTS[0], 4000))
    assert sync_client.get_outputs(10.0) is not None
    workers = descendants(engine_process.pid)
    assert workers, "the mp executor runs its workers as child processes"

    async def scenario() -> float:
        client = await AsyncEngineClient.start(address=engine_process.address)
        try:
            streams = [
                await client.add_request(greedy(f"a{i}", p, 4000)) for i, p in enumerate(PROMPTS)
            ]
            for stream in streams:
                await anext(stream)
            os.kill(engine_process.pid, signal.SIGKILL)
            killed_at = time.monotonic()

            async def drain(stream) -> None:
                with pytest.raises(EngineDeadError):
                    async for _ in stream:
                        pass

            await asyncio.wait_for(asyncio.gather(*(drain(s) for s in streams)), 10.0)
            with pytest.raises(EngineDeadError):
                await client.add_request(greedy("too-late", PROMPTS[0]))
            return killed_at
        finally:
            await client.shutdown()

    killed_at = run_async(scenario())
    with pytest.raises(EngineDeadError):
        collect(sync_client)
    assert time.monotonic() - killed_at < 5.0, "clients took too long to notice"
    with pytest.raises(EngineDeadError):
        sync_client.add_request(greedy("too-late", PROMPTS[0]))
    assert wait_until_gone(workers, 5.0) == [], "workers outlived their engine"


@pytest.mark.slow
def test_an_async_client_can_own_its_engine(tiny_model_dir, reference):
    config = EngineArgs(model=str(tiny_model_dir), kv_cache_memory=SMALL_KV).create_engine_config()

    async def scenario() -> int:
        client = await AsyncEngineClient.start(config, ready_timeout_s=60.0)
        try:
            stream = await client.add_request(greedy("r", PROMPTS[2]))
            assert [t async for out in stream for t in out.new_token_ids] == reference[2]
            return client.engine_pid
        finally:
            await client.shutdown()

    engine_pid = run_async(scenario(), "uvloop")
    assert wait_until_gone([engine_pid], 5.0) == []


def test_start_failures_are_reported_not_hung(tmp_path):
    nowhere = f"ipc://{tmp_path / 'nobody.sock'}"
    started = time.monotonic()
    with pytest.raises(EngineStartError, match="not ready within"):
        MPEngineClient(address=nowhere, ready_timeout_s=0.5)
    with pytest.raises(EngineStartError, match="not ready within"):
        run_async(AsyncEngineClient.start(address=nowhere, ready_timeout_s=0.5))
    assert time.monotonic() - started < 5.0
    with pytest.raises(ValueError, match="either a config"):
        MPEngineClient()
    with pytest.raises(ValueError, match="engine must be"):
        LLM(engine="threads")


@pytest.mark.slow
def test_an_engine_that_cannot_load_its_model_is_reported(tiny_model_dir, tmp_path):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    config = EngineArgs(model=str(broken), kv_cache_memory=SMALL_KV).create_engine_config()
    with pytest.raises(EngineStartError, match="exited with code 1 before it was ready"):
        MPEngineClient(config, ready_timeout_s=60.0)


@pytest.mark.slow
def test_a_busy_event_loop_does_not_starve_the_heartbeats_and_a_stuck_one_is_dropped(
    tiny_model_dir: Path,
):
    """Heartbeats come from the client's socket thread: a loop blocked for twice the engine's
    heartbeat timeout keeps its session; one that answers nothing for longer than the stall
    limit stops heartbeating and is dropped (``session_lost``), as a stuck frontend must be."""

    async def scenario(engine: EngineProcess) -> None:
        client = await AsyncEngineClient.start(address=engine.address, heartbeat_interval_s=0.5)
        try:
            time.sleep(4.0)  # the loop does nothing else: twice the engine's patience
            await asyncio.sleep(0.5)
            assert not client.session_lost and client.dead_reason is None
            stream = await client.add_request(greedy("after-busy", PROMPTS[0]))
            assert len([t async for out in stream for t in out.new_token_ids]) == NUM_TOKENS
            stuck_for = async_client.LOOP_STALL_LIMIT_S + 3.0
            time.sleep(stuck_for)  # past the stall limit, and then past the engine's patience
            await asyncio.sleep(0.5)
            assert client.session_lost, "a stuck loop kept its session"
        finally:
            await client.shutdown()

    with (
        running_engine(tiny_model_dir, "inprocess", 2.0) as engine,
        pytest.MonkeyPatch.context() as patch,
    ):
        patch.setattr(async_client, "LOOP_STALL_LIMIT_S", 6.0)
        run_async(scenario(engine))


def test_a_client_heartbeats_often_enough_for_a_strict_engine(tiny_model_dir: Path):
    """The engine says its heartbeat timeout in Ready; a client asked to heartbeat every 2 s
    beats four times per timeout instead (one late heartbeat must not get it dropped), while
    the time it gives a silent engine stays with the interval it was asked for."""
    assert heartbeat_interval(2.0, 0.0) == 2.0  # an engine that did not say
    assert heartbeat_interval(2.0, 10.0) == 2.0
    assert heartbeat_interval(2.0, 3.0) == 0.75

    async def scenario(engine: EngineProcess) -> None:
        client = await AsyncEngineClient.start(address=engine.address, heartbeat_interval_s=2.0)
        try:
            assert client.engine_heartbeat_timeout_s == 2.0
            assert client._io._heartbeat_interval_s == 0.5
            assert client._io.silence_limit_s == 2.0 * SILENCE_HEARTBEATS
            await asyncio.sleep(5.0)  # two and a half of the engine's timeouts, idle
            assert not client.session_lost and client.dead_reason is None
            stream = await client.add_request(greedy("after-idle", PROMPTS[0]))
            assert len([t async for out in stream for t in out.new_token_ids]) == NUM_TOKENS
        finally:
            await client.shutdown()

    with running_engine(tiny_model_dir, "inprocess", 2.0) as engine:
        run_async(scenario(engine))
