"""Tensor parallelism across hosts: ``conveyor serve --nnodes 2`` on the head and
``conveyor serve --headless`` on a second "host", each its own process tree on loopback (gloo,
CURVE keys).

Runs in the test process, which also plays a frontend on the head host. Every server listens on
127.0.0.1 only, every wait is bounded, and a fixture finalizer kills whatever a failing test left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conveyor.frontend.engine_client import MPEngineClient
from conveyor.frontend.engine_client.session import EngineStartError
from conveyor.runtime.zmq_security import CURVE_KEYS_ENV, load_keys
from tests.commands import CONVEYOR
from tests.curve_keys import trusted_key_dirs
from tests.entrypoints.host_helpers import (
    ENGINE_FLAGS,
    Host,
    free_ports,
    head_address,
    reference_tokens,
    served_tokens,
)
from tests.process_tree import kill_all, wait_until_gone

# One xdist group for the modules that start several engines, hosts or a Ray cluster each: run
# side by side on a 2-core machine they starve each other's (and the timing tests') heartbeats.
pytestmark = pytest.mark.xdist_group("multi-engine")

NODE_TIMEOUT_S = 3.0


@pytest.fixture
def key_dirs(tmp_path: Path) -> dict[str, Path]:
    """The head and node 1 trust each other; the stranger knows the head's public key only."""
    return trusted_key_dirs(tmp_path / "keys")


@pytest.fixture
def hosts(tiny_model_dir: Path, tmp_path: Path) -> Iterator:
    """start(node_rank, keys, *flags) -> Host, all sharing one master port."""
    started: list[Host] = []
    master_port = free_ports(8)

    def start(node_rank: int, keys: Path, *flags: str) -> Host:
        command = [*CONVEYOR, "serve", str(tiny_model_dir), *ENGINE_FLAGS]
        command += ["--nnodes", "2", "--node-rank", str(node_rank)]
        command += ["--master-port", str(master_port), "--node-timeout-s", str(NODE_TIMEOUT_S)]
        command += ["--curve-keys", str(keys), *flags]
        host = Host(command, tmp_path / f"node{node_rank}.log")
        started.append(host)
        return host

    yield start
    for host in started:
        pids = host.tree()
        if host.process.poll() is None:
            host.process.kill()
            host.process.wait(5.0)
        kill_all(pids)


def _assert_no_secret_shows(pids: list[int], logs: list[Path], key_dirs: dict[str, Path]) -> None:
    """Row 21: keys travel by folder path; no secret key on a command line or in a log."""
    secrets = [load_keys(key_dirs[name]).secret_key.decode() for name in ("head", "node1")]
    cmdlines = [Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace") for pid in pids]
    for text in [*cmdlines, *(log.read_text() for log in logs)]:
        assert not any(secret in text for secret in secrets)


def _kill_tree(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_two_hosts_give_the_tokens_of_one_and_a_lost_host_stops_the_head(
    hosts, key_dirs, tiny_model_dir, monkeypatch
):
    """TP=2 over two process trees equals TP=1 token for token; the engine's own TCP socket is
    CURVE as well (a stranger's key gets no session); killing the remote tree stops the head
    with the reason within the heartbeat timeout, and nothing is left of either tree."""
    engine_address = f"tcp://127.0.0.1:{free_ports(1)}"
    head = hosts(0, key_dirs["head"], "--frontends", "0", "--address", engine_address)
    node = hosts(1, key_dirs["node1"], "--headless")
    assert head_address(head) == engine_address
    expected = reference_tokens(tiny_model_dir)
    monkeypatch.setenv(CURVE_KEYS_ENV, str(key_dirs["stranger"]))
    with pytest.raises(EngineStartError, match="not ready within"):
        MPEngineClient(address=engine_address, ready_timeout_s=2.0)
    monkeypatch.setenv(CURVE_KEYS_ENV, str(key_dirs["head"]))  # a frontend on the head host
    assert served_tokens(engine_address) == expected
    trees = head.tree() + node.tree()
    assert len(trees) == 5, "head: serve, engine core, rank 0; node: headless, rank 1"
    _assert_no_secret_shows(trees, [head.log, node.log], key_dirs)

    killed_at = time.monotonic()
    _kill_tree(node.tree())
    assert head.process.wait(NODE_TIMEOUT_S + 15.0) == 1
    assert time.monotonic() - killed_at < NODE_TIMEOUT_S + 15.0
    assert "node 1 (ranks 1-1) is gone: no heartbeat" in head.log.read_text()
    assert wait_until_gone(trees, 10.0) == []


@pytest.mark.slow
def test_a_host_whose_key_the_head_does_not_trust_never_joins(hosts, key_dirs):
    """The stranger reaches torch.distributed's store (not ZeroMQ, not authenticated) but none
    of the head's ZeroMQ sockets: both sides give up at the join timeout and say why."""
    join = ["--node-join-timeout-s", "8"]
    head = hosts(0, key_dirs["head"], "--frontends", "0", *join)
    node = hosts(1, key_dirs["stranger"], "--headless", *join)
    assert head.process.wait(60.0) == 1
    assert node.process.wait(30.0) == 1
    assert "node 1 (ranks 1-1) did not join within 8 s" in head.log.read_text()
    assert "refused connections from unauthorized key" in head.log.read_text()
    assert "was not heard within 8 s" in node.log.read_text()
    assert wait_until_gone(head.tree() + node.tree(), 10.0) == []


@pytest.mark.parametrize("address", ["127.0.0.1", "10.1.2.3"], ids=["loopback", "public"])
@pytest.mark.parametrize("role", [["--node-rank", "0"], ["--node-rank", "1", "--headless"]])
def test_hosts_without_keys_are_refused_before_anything_starts(role, address, monkeypatch):
    """Row 25: even on loopback, where any local user could take a rank's channel."""
    monkeypatch.delenv(CURVE_KEYS_ENV, raising=False)
    command = [*CONVEYOR, "serve", "--frontends", "0", "--tensor-parallel-size", "2"]
    command += ["--nnodes", "2", "--master-addr", address, *role]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert f"tcp://{address}:29500 links conveyor processes of several hosts" in result.stderr
    assert "--curve-keys DIR" in result.stderr and "worker" not in result.stderr
