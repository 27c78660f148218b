"""``python -m conveyor.entrypoints.engine`` on the tiny model, stopped and broken on purpose.

SIGTERM exits 0 and tells every client; SIGKILL fails every open request within seconds; a worker
that raises or dies (mid-step or while the engine idles) is fatal: EngineDead, exit 1. No test
leaves a process behind: a fixture finalizer stops each engine and kills any worker left.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conveyor.executor.worker_processes import OPENMP_SPIN_COUNT, openmp_env, worker_env
from conveyor.frontend.engine_args import EngineArgs
from conveyor.frontend.engine_client.engine_process import EngineProcess
from conveyor.frontend.engine_client.session import EngineDeadError
from conveyor.protocol import EngineConfig, EngineCoreRequest
from tests.devices import x86_only
from tests.engine_core.core_process_helpers import (
    ClientPool,
    collect,
    request,
)
from tests.process_tree import descendants, kill_all, wait_until_gone


@pytest.fixture
def make_client() -> Iterator[ClientPool]:
    with ClientPool() as pool:
        yield pool


@pytest.fixture
def engine_processes() -> Iterator:
    """Starts ``python -m conveyor.entrypoints.engine`` processes; kills them and their workers at the end."""
    started: list[tuple[EngineProcess, list[int]]] = []

    def start(config: EngineConfig, **kwargs: object) -> EngineProcess:
        engine = EngineProcess(config, **kwargs).start()  # type: ignore[arg-type]
        started.append((engine, []))
        engine.wait_ready(60.0)
        started[-1][1].extend(descendants(engine.pid))
        return engine

    yield start
    for engine, children in started:
        engine.stop(5.0)
        kill_all(children)


def tiny_config(model_dir: Path) -> EngineConfig:
    return EngineArgs(model=str(model_dir), kv_cache_memory=16 << 20).create_engine_config()


def tiny_request(request_id: str, max_tokens: int = 2000) -> EngineCoreRequest:
    return request(request_id, [5, 6, 7, 8], max_tokens)


@pytest.mark.slow
def test_sigterm_exits_zero_tells_clients_and_leaves_no_children(
    tiny_model_dir, engine_processes, make_client, monkeypatch
):
    # As on a host where nobody set how OpenMP waits (the suite sets it: tests/devices.py).
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    engine = engine_processes(tiny_config(tiny_model_dir), executor_backend="mp")
    children = descendants(engine.pid)
    assert children, "the mp executor's worker process"
    # Each in a session (on Linux, a scheduling group) of its own: sharing the engine core's, the
    # worker's compute threads kept other processes off the cores for up to 1.8 s.
    assert [os.getsid(pid) for pid in children] == children and os.getsid(engine.pid) == engine.pid
    environ = Path(f"/proc/{children[0]}/environ").read_bytes().split(b"\0")
    assert f"GOMP_SPINCOUNT={OPENMP_SPIN_COUNT}".encode() in environ
    client = make_client(engine.address)
    client.add_request(tiny_request("open"))
    assert client.get_outputs(10.0) is not None
    os.kill(engine.pid, signal.SIGTERM)
    assert engine.process.wait(10.0) == 0
    with pytest.raises(EngineDeadError, match="shut down"):
        collect(client)
    assert wait_until_gone(children, 5.0) == []


def test_how_openmp_waits_is_left_to_whoever_already_said(monkeypatch):
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    assert openmp_env() == {"GOMP_SPINCOUNT": str(OPENMP_SPIN_COUNT)}
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert openmp_env() == {}
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "infinite")
    assert openmp_env() == {}


@x86_only
def test_workers_get_the_cpu_isa_limits_unless_the_user_set_them(monkeypatch):
    from conveyor.protocol.config import NodeConfig

    monkeypatch.setenv("CONVEYOR_CPU_ISA", "avx2")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2_VNNI")
    env = worker_env(NodeConfig())
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    assert "ONEDNN_MAX_CPU_ISA" not in env  # inherited as the user set it
    monkeypatch.delenv("CONVEYOR_CPU_ISA")
    assert "ATEN_CPU_CAPABILITY" not in worker_env(NodeConfig())


@pytest.mark.slow
def test_sigkill_fails_open_requests_within_seconds_and_orphans_nothing(
    tiny_model_dir, engine_processes, make_client
):
    engine = engine_processes(tiny_config(tiny_model_dir), executor_backend="mp")
    children = descendants(engine.pid)
    assert children, "the mp executor's worker process"
    client = make_client(engine.address)
    for i in range(3):
        client.add_request(tiny_request(f"open-{i}"))
    assert client.get_outputs(10.0) is not None
    os.kill(engine.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    with pytest.raises(EngineDeadError):
        collect(client, timeout_s=30.0)
    assert time.monotonic() - killed_at < 5.0
    assert not client.has_unfinished_requests()
    assert wait_until_gone(children, 5.0) == [], "workers outlived their engine"


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["raise", "sigkill", "sigkill-while-idle"])
def test_a_worker_fault_is_fatal_engine_dead_and_nonzero_exit(
    tiny_model_dir, engine_processes, make_client, monkeypatch, fault
):
    if fault == "raise":
        monkeypatch.setenv("CONVEYOR_FAULT_INJECT", "raise@step=4")
    engine = engine_processes(tiny_config(tiny_model_dir), executor_backend="mp")
    children = descendants(engine.pid)
    assert len(children) == 1, "one worker process"
    client = make_client(engine.address)
    if fault != "sigkill-while-idle":
        client.add_request(tiny_request("doomed", 2000))
        assert client.get_outputs(10.0) is not None
    if fault.startswith("sigkill"):
        os.kill(children[0], signal.SIGKILL)
    failed_at = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 0"):
        # An idle engine notices too (it asks the executor while waiting for work).
        collect(client, timeout_s=30.0)
        client.get_outputs(10.0)
    assert time.monotonic() - failed_at < 5.0
    assert engine.process.wait(10.0) == 1
    assert wait_until_gone(children, 5.0) == []


@pytest.mark.slow
def test_a_hung_step_is_fatal_within_the_step_timeout(
    tiny_model_dir, engine_processes, make_client, monkeypatch
):
    monkeypatch.setenv("CONVEYOR_FAULT_INJECT", "hang@step=4")
    config = EngineArgs(
        model=str(tiny_model_dir), kv_cache_memory=16 << 20, step_timeout_s=2.0
    ).create_engine_config()
    engine = engine_processes(config, executor_backend="mp")
    children = descendants(engine.pid)
    client = make_client(engine.address)
    client.add_request(tiny_request("stuck"))
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="hung"):
        collect(client, timeout_s=30.0)
    assert time.monotonic() - started < 2.0 + 4.0
    assert engine.process.wait(10.0) == 3
    # The hung worker notices its engine is gone and exits too.
    assert wait_until_gone(children, 5.0) == []
