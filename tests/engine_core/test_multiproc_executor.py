"""MultiprocExecutor with real worker processes on the tiny model, driven by EngineCore.

Parity with the in-process executor, junk frames, a killed worker, a worker that raises, a worker
that fails to start, and an engine killed under its workers. Every wait is bounded, and every
test checks that no process it started outlives it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from conveyor.engine_core import EngineCore
from conveyor.executor.backends import make_executor
from conveyor.executor.multiproc import (
    ExecutorError,
    MultiprocExecutor,
    WorkerDiedError,
    WorkerFailedError,
    WorkerTimeoutError,
)
from conveyor.protocol import EngineConfig, EngineCoreRequest
from conveyor.protocol.messages import ModelRunnerOutput
from conveyor.protocol.worker_messages import (
    WORKER_COMMAND,
    WORKER_REPLY,
    InitializeCache,
    StepOutput,
    WorkerReady,
)
from tests.multiproc_helpers import (
    GREEDY,
    child_pids,
    generate,
    is_alive,
    make_config,
    make_requests,
    wait_until_gone,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def config(tiny_model_dir: Path) -> EngineConfig:
    return make_config(tiny_model_dir)


@pytest.fixture(scope="module")
def expected_tokens(config: EngineConfig) -> dict[str, list[int]]:
    core = EngineCore(config, make_executor(config, "inprocess"))
    try:
        return generate(core, make_requests())
    finally:
        core.shutdown()


@pytest.fixture(scope="module")
def mp_engine(config: EngineConfig):
    """One engine on one worker process, shared by the tests that leave it healthy."""
    executor = MultiprocExecutor(config, startup_timeout_s=60)
    try:
        core = EngineCore(config, executor)
        yield core, executor
    finally:
        executor.shutdown()
        wait_until_gone(executor.worker_pids)


@pytest.mark.slow
def test_greedy_and_seeded_tokens_match_the_in_process_executor(mp_engine, expected_tokens):
    core, _ = mp_engine
    assert generate(core, make_requests()) == expected_tokens


@pytest.mark.slow
def test_junk_frames_are_dropped_by_the_worker_and_by_the_engine(mp_engine, expected_tokens):
    core, executor = mp_engine
    # To the worker: bytes that are not msgpack, and a reply where a command belongs.
    for junk in (b"\x00junk", b"", WORKER_REPLY.encode(WorkerReady(0, 1))):
        assert executor._workers.send(0, junk)
    # To the engine's reply socket: garbage, a command, and a stale step output.
    context = zmq.Context()
    intruder = context.socket(zmq.PUSH)
    intruder.connect(executor.reply_address)
    stale = StepOutput(ModelRunnerOutput(step_id=10**6, req_ids=[1], sampled_token_ids=[1]))
    for junk in (
        b"\xc1\xff",
        WORKER_COMMAND.encode(InitializeCache(1)),
        WORKER_REPLY.encode(stale),
    ):
        intruder.send(junk)
    intruder.close(linger=1000)
    context.term()
    tokens = generate(core, make_requests())
    # Unseeded sampling draws from the worker's global generator, which earlier runs advanced.
    del tokens["unseeded"]
    assert tokens == {k: v for k, v in expected_tokens.items() if k != "unseeded"}
    assert all(is_alive(pid) for pid in executor.worker_pids)


def test_the_executor_module_does_not_import_torch():
    code = "import sys, conveyor.executor.multiproc; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def _started_engine(config: EngineConfig) -> tuple[EngineCore, MultiprocExecutor]:
    executor = MultiprocExecutor(config, startup_timeout_s=60)
    return EngineCore(config, executor), executor


@pytest.mark.slow
def test_a_killed_worker_raises_worker_died_error_and_shutdown_leaves_no_process(config):
    core, executor = _started_engine(config)
    pids = executor.worker_pids
    try:
        core.add_request(EngineCoreRequest("a", [1, 2, 3, 4], GREEDY, 0.0))
        core.step()
        executor.check_health()
        os.kill(pids[0], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"rank 0 .* killed by SIGKILL") as died:
            for _ in range(20):
                core.step()
        assert time.monotonic() - start < 3.0
        assert died.value.rank == 0
        with pytest.raises(WorkerDiedError):
            executor.check_health()
        # Broken for good: the next call fails at once with the same error, it does not hang.
        with pytest.raises(WorkerDiedError):
            executor.execute_model(core.scheduler.schedule())
    finally:
        core.shutdown()
    wait_until_gone(pids, timeout_s=1.0)
    assert not child_pids() & set(pids)
    core.shutdown()  # idempotent
    with pytest.raises(ExecutorError):
        executor.determine_num_blocks()


@pytest.mark.slow
def test_an_idle_engine_notices_a_dead_worker_through_check_health(config):
    executor = MultiprocExecutor(config, startup_timeout_s=60)
    try:
        executor.check_health()
        os.kill(executor.worker_pids[0], signal.SIGTERM)
        deadline = time.monotonic() + 3.0
        with pytest.raises(WorkerDiedError, match="SIGTERM"):
            while time.monotonic() < deadline:
                executor.check_health()
                time.sleep(0.02)
    finally:
        executor.shutdown()
    wait_until_gone(executor.worker_pids, timeout_s=1.0)


@pytest.mark.slow
def test_an_exception_in_a_worker_step_surfaces_as_worker_failed_error(config, monkeypatch):
    monkeypatch.setenv("CONVEYOR_FAULT_INJECT", "raise@step=3")
    core, executor = _started_engine(config)
    pids = executor.worker_pids
    try:
        core.add_request(EngineCoreRequest("a", [1, 2, 3, 4], GREEDY, 0.0))
        core.step()
        core.step()
        start = time.monotonic()
        with pytest.raises(WorkerFailedError, match="InjectedFault") as failed:
            core.step()
        assert time.monotonic() - start < 3.0
        assert failed.value.rank == 0
    finally:
        core.shutdown()
    wait_until_gone(pids, timeout_s=1.0)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "error", "match"),
    [("raise@load", WorkerFailedError, "InjectedFault"), ("exit@load", WorkerDiedError, "code 17")],
)
def test_a_worker_that_fails_to_start_is_reported_and_leaves_no_process(
    config, monkeypatch, fault, error, match
):
    monkeypatch.setenv("CONVEYOR_FAULT_INJECT", fault)
    before = child_pids()
    start = time.monotonic()
    with pytest.raises(error, match=match):
        MultiprocExecutor(config, startup_timeout_s=60)
    assert time.monotonic() - start < 15.0
    assert child_pids() <= before


def _engine_script(config: EngineConfig, tmp_path: Path, then: str) -> str:
    """An engine process that starts an executor, prints its worker pids and folder, then ``then``."""
    config_file = tmp_path / "config.msgpack"
    config_file.write_bytes(msgspec.msgpack.encode(config))
    return textwrap.dedent(
        f"""
        import sys, time, msgspec
        from conveyor.executor.multiproc import MultiprocExecutor
        from conveyor.protocol import EngineConfig
        config = msgspec.msgpack.decode(open({str(config_file)!r}, "rb").read(), type=EngineConfig)
        executor = MultiprocExecutor(config, startup_timeout_s=60)
        print(executor._workers.runtime_dir, *executor.worker_pids, flush=True)
        {then}
        """
    )


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGKILL", "exit without shutdown"])
def test_workers_exit_with_the_engine_process(config, tmp_path, how):
    """SIGKILL gives the engine no chance to clean up: the workers notice on their own (stdin
    EOF) and remove the engine's runtime folder. A plain exit that forgot shutdown runs the
    executor's finalizer, which stops the workers and removes the folder."""
    then = "time.sleep(60)" if how == "SIGKILL" else "sys.exit(0)"
    engine = subprocess.Popen(
        [sys.executable, "-c", _engine_script(config, tmp_path, then)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert engine.stdout is not None
        runtime_dir, *pids = engine.stdout.readline().split()
        assert pids and Path(runtime_dir).is_dir()
        if how == "SIGKILL":
            engine.kill()
        assert engine.wait(timeout=10) == (-signal.SIGKILL if how == "SIGKILL" else 0)
        wait_until_gone([int(p) for p in pids], timeout_s=5.0)
        # Removed by the finalizer, or by the workers when the engine was killed.
        assert not Path(runtime_dir).exists()
    finally:
        engine.kill()
        engine.wait(timeout=5)


@pytest.mark.slow
def test_a_hung_step_times_out_and_shutdown_still_stops_the_worker(config, monkeypatch):
    monkeypatch.setenv("CONVEYOR_FAULT_INJECT", "hang@step=2")
    executor = MultiprocExecutor(config, startup_timeout_s=60, step_timeout_s=1.0)
    core = EngineCore(config, executor)
    try:
        core.add_request(EngineCoreRequest("a", [1, 2, 3, 4], GREEDY, 0.0))
        core.step()
        start = time.monotonic()
        with pytest.raises(WorkerTimeoutError):
            core.step()
        assert 1.0 <= time.monotonic() - start < 3.0
    finally:
        core.shutdown()
    wait_until_gone(executor.worker_pids, timeout_s=1.0)
