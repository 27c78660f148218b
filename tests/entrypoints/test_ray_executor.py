"""``--distributed-executor-backend ray``: the tensor-parallel ranks as Ray actors in a placement
group on a local single-node Ray cluster (``ray start --head``), serving the tokens of one rank;
with ``--data-parallel-size 2``, the engine cores as Ray actors too, both serving HTTP requests.

Runs in the test process, which never joins the cluster itself (the engine process does). The
cluster is this test's own: started with ``--block`` and stopped by the pids of its tree.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.commands import CONVEYOR
from tests.entrypoints.host_helpers import (
    ENGINE_FLAGS,
    Host,
    free_ports,
    head_address,
    reference_tokens,
    served_tokens,
)
from tests.frontend.http_helpers import (
    MODEL_NAME,
    get,
    metric,
    parse_metrics,
    post_json,
    start_served_http,
    wait_for,
)
from tests.process_tree import descendants, kill_all, wait_until_gone

pytest.importorskip("ray", reason="ray is not installed (pip install '.[ray]')")

# One xdist group for the modules that start several engines, hosts or a Ray cluster each: run
# side by side on a 2-core machine they starve each other's (and the timing tests') heartbeats.
pytestmark = pytest.mark.xdist_group("multi-engine")

RAY = [str(Path(sys.executable).parent / "ray")]
PLACED = re.compile(r"Ray placed ranks on .* \(pids \[(\d+), (\d+)\]\)")


def _ray_status(address: str) -> str:
    result = subprocess.run(
        [*RAY, "status", "--address", address], capture_output=True, text=True, timeout=60
    )
    return result.stdout


@pytest.fixture
def ray_cluster(request: pytest.FixtureRequest) -> Iterator[str]:
    """A head node of our own, of two logical CPUs unless parametrized; its address."""
    num_cpus = getattr(request, "param", 2)
    port = free_ports(1)
    # Ray's socket paths must stay short: not under pytest's deep tmp_path.
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    command = [*RAY, "start", "--head", "--block", "--port", str(port), "--num-cpus", str(num_cpus)]
    command += ["--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", temp_dir]
    head = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60.0
        while "CPU" not in _ray_status(address):
            assert head.poll() is None and time.monotonic() < deadline, "ray did not start"
            time.sleep(0.5)
        yield address
    finally:
        tree = [head.pid, *descendants(head.pid)]
        head.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            head.wait(15.0)
        kill_all(tree)
        wait_until_gone(tree, 10.0)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
def test_ray_places_two_ranks_that_serve_the_tokens_of_one(
    ray_cluster, tiny_model_dir, tmp_path, monkeypatch
):
    """Ray only places the ranks (a placement group of two CPU bundles); the engine talks to
    them over its own sockets. A rank's actor killed with SIGKILL is a dead worker: the server
    stops with the reason, and the placement group's CPUs are free again."""
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster)
    command = [*CONVEYOR, "serve", str(tiny_model_dir), *ENGINE_FLAGS, "--frontends", "0"]
    command += ["--distributed-executor-backend", "ray"]
    server = Host(command, tmp_path / "serve.log")
    try:
        address = head_address(server)
        assert served_tokens(address) == reference_tokens(tiny_model_dir)
        placed = PLACED.search(server.log.read_text())
        assert placed, server.log.read_text()
        # Placed by Ray: the ranks are not the server's children.
        rank_pids = [int(pid) for pid in placed.groups()]
        assert not set(rank_pids) & set(descendants(server.process.pid))
        # `ray status` reports what the nodes last told the head, a beat behind the placement.
        _wait_for_cpus(ray_cluster, "2.0/2.0 CPU")

        os.kill(rank_pids[1], signal.SIGKILL)
        assert server.process.wait(30.0) == 1
        assert f"worker rank 1 (pid {rank_pids[1]}) was killed by SIGKILL" in server.log.read_text()
        deadline = time.monotonic() + 30.0
        while "0.0/2.0 CPU" not in _ray_status(ray_cluster):
            assert time.monotonic() < deadline, "the placement group was not freed"
            time.sleep(0.5)
        assert wait_until_gone(rank_pids, 10.0) == []
    finally:
        kill_all([server.process.pid, *descendants(server.process.pid)])


def _wait_for_cpus(address: str, usage: str) -> None:
    deadline = time.monotonic() + 30.0
    while usage not in _ray_status(address):
        assert time.monotonic() < deadline, f"not {usage}:\n{_ray_status(address)}"
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.parametrize("ray_cluster", [4], indirect=True)
def test_ray_places_data_parallel_engines_that_both_serve(ray_cluster, tiny_model_dir, tmp_path):
    """Two engine cores as Ray actors (a CPU each) with a rank each (a CPU each): both serve the
    frontend's requests; a killed engine actor is restarted; SIGTERM stops the server with every
    actor gone."""
    extra = ["--data-parallel-size", "2", "--distributed-executor-backend", "ray"]
    extra += ["--max-num-seqs", "2", "--router", "least-loaded", "--device", "cpu"]
    served = start_served_http(
        tiny_model_dir, tmp_path / "serve.log", extra, 180.0, {"RAY_ADDRESS": ray_cluster}
    )
    try:
        engine_pids = list(served.dp_engine_pids.values())
        assert sorted(served.dp_engine_pids) == [0, 1]
        # Placed by Ray: the engines are not the server's children.
        assert not set(engine_pids) & set(descendants(served.process.pid))
        _wait_for_cpus(ray_cluster, "4.0/4.0 CPU")
        body = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0, "ignore_eos": True}

        def complete(index: int) -> int:
            return post_json(served.base_url, "/v1/completions", {**body, "prompt": f"{index}"})[0]

        # At once, so both engines take some (least-loaded spreads a burst).
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            assert list(pool.map(complete, range(6))) == [200] * 6
        samples = parse_metrics(get(served.base_url, "/metrics")[1])
        for engine in ("0", "1"):
            assert metric(samples, "conveyor:request_success_total", engine=engine) > 0

        # A killed engine actor is a dead engine: restarted in place, in its bundle.
        os.kill(engine_pids[1], signal.SIGKILL)
        restarted = wait_for(lambda: "engine_core-1 serves again" in served.log.read_text(), 90.0)
        assert restarted, _ray_status(ray_cluster)
        assert complete(0) == 200

        served.process.send_signal(signal.SIGTERM)
        assert served.process.wait(60.0) == 0, served.log.read_text()
        _wait_for_cpus(ray_cluster, "0.0/4.0 CPU")
        assert wait_until_gone(engine_pids, 10.0) == []
    finally:
        served.stop()


def test_a_stop_signal_inside_rays_wait_stays_a_stop(monkeypatch):
    """A SIGTERM that lands while the supervisor polls an engine actor runs our handler from
    Ray's own signal check, and Ray returns the ShutdownRequested wrapped in a SystemError (seen
    once in CI: the server then exited 1 with a traceback); the poll re-raises the stop itself."""
    import ray

    from conveyor.entrypoints.ray_engines import RayEngineProcess
    from conveyor.runtime.signals import ShutdownRequested

    def interrupted(*args, **kwargs):
        try:
            raise ShutdownRequested("SIGTERM")
        except ShutdownRequested as stop:
            raise SystemError("CoreWorker.wait returned a result with an exception set") from stop

    engine = RayEngineProcess.__new__(RayEngineProcess)
    engine._run_ref = object()
    monkeypatch.setattr(ray, "wait", interrupted)
    with pytest.raises(ShutdownRequested):
        engine.exit_code()
    monkeypatch.setattr(ray, "wait", lambda *a, **k: (_ for _ in ()).throw(SystemError("other")))
    with pytest.raises(SystemError):
        engine.exit_code()
