"""Data parallelism across hosts: the head (``conveyor serve --data-parallel-size 2
--data-parallel-size-local 1``: engine 0 and the frontend) and a second "host" (``--headless
--data-parallel-start-rank 1``: engine 1), each its own process tree on loopback, CURVE keys.

Runs in the test process. Every server listens on 127.0.0.1 only, every wait is bounded, and the
fixtures kill whatever a failing test left.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import re
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from conveyor.entrypoints import dp_hosts
from conveyor.entrypoints.dp_hosts import DataParallelLayout, EngineAnnouncer
from conveyor.frontend import LLM
from conveyor.frontend.engine_client import MPEngineClient
from conveyor.frontend.engine_client.session import EngineStartError
from conveyor.protocol import SamplingParams
from conveyor.protocol.node_messages import NODE_MESSAGE, EngineAnnounce
from conveyor.runtime.zmq_security import CURVE_KEYS_ENV, load_keys, with_server_key
from tests.commands import CONVEYOR
from tests.curve_keys import trusted_key_dirs
from tests.entrypoints.host_helpers import Host, free_ports
from tests.frontend.http_helpers import (
    MODEL_NAME,
    ServedHttp,
    get,
    metric,
    parse_metrics,
    post_json,
    start_served_http,
    wait_for,
)
from tests.process_tree import kill_all
from tests.stranger import stranger

# One xdist group for the modules that start several engines, hosts or a Ray cluster each: run
# side by side on a 2-core machine they starve each other's (and the timing tests') heartbeats.
pytestmark = pytest.mark.xdist_group("multi-engine")

PROMPTS = [f"def function_{i}(x):\n    return" for i in range(4)]
MAX_TOKENS = 8
DP_FLAGS = ["--data-parallel-size", "2", "--data-parallel-size-local", "1"]
REMOTE_READY = re.compile(r"^ready: engine_core-1 pid=(\d+) address=(\S+)\s*$")
# What a stranger announces for rank 1: an address of its own, and no key.
STRANGER_ANNOUNCE = NODE_MESSAGE.encode(EngineAnnounce(1, "tcp://127.0.0.1:9", ""))


@pytest.fixture
def key_dirs(tmp_path: Path) -> dict[str, Path]:
    """The head and node 1 trust each other; the stranger knows the head's public key only."""
    return trusted_key_dirs(tmp_path / "keys")


@pytest.fixture
def two_hosts(tiny_model_dir: Path, tmp_path: Path, key_dirs) -> Iterator:
    """(head, node): node 1 started first (the head waits for its engine), then the head, with
    a stranger (another local user) announcing rank 1 at the head's port all the while."""
    rpc_port = free_ports(3)
    rpc = ["--data-parallel-rpc-port", str(rpc_port)]
    command = [*CONVEYOR, "serve", str(tiny_model_dir), "--kv-cache-memory", "16M", *DP_FLAGS]
    command += ["--headless", "--data-parallel-start-rank", "1", *rpc]
    node = Host([*command, "--curve-keys", str(key_dirs["node1"])], tmp_path / "node1.log")
    head: ServedHttp | None = None
    head_key = load_keys(key_dirs["head"]).public_key
    try:
        extra = [*DP_FLAGS, *rpc, "--router", "round-robin", "--node-join-timeout-s", "90"]
        extra += ["--curve-keys", str(key_dirs["head"])]
        with stranger(f"tcp://127.0.0.1:{rpc_port}", head_key, STRANGER_ANNOUNCE):
            head = start_served_http(tiny_model_dir, tmp_path / "head.log", extra, timeout_s=180.0)
        yield head, node
    finally:
        if head is not None:
            head.stop()
        pids = node.tree()
        node.process.kill()
        node.process.wait(5.0)
        kill_all(pids)


def _complete(base_url: str, prompt: str) -> str:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS}
    body.update(temperature=0, ignore_eos=True)
    status, _, answer = post_json(base_url, "/v1/completions", body)
    assert status == 200, answer
    return answer["choices"][0]["text"]


def _successes(base_url: str, engine: str) -> float:
    samples = parse_metrics(get(base_url, "/metrics")[1])
    return metric(samples, "conveyor:request_success_total", engine=engine)


def _remote_engine(node: Host) -> tuple[int, str]:
    line = node.lines.get(timeout=5.0)  # printed before the head could serve
    match = REMOTE_READY.match(line)
    assert match, line
    return int(match[1]), match[2]


@pytest.mark.slow
def test_an_engine_on_another_host_serves_behind_the_heads_router(
    two_hosts, key_dirs, tiny_model_dir, monkeypatch
):
    """Both engines serve HTTP requests (per-engine metrics) with one engine's greedy tokens;
    the head took rank 1 from its host, not from the stranger; the remote engine admits only
    keys it trusts; killed, it is routed around, restarted by its own host and used again."""
    head, node = two_hosts
    remote_pid, remote_address = _remote_engine(node)
    head_log = head.log.read_text()
    assert f"data-parallel engine 1 is at {remote_address}?curve-server-key=" in head_log
    assert "refused connections from unauthorized key" in head_log
    assert "tcp://127.0.0.1:9" not in head_log
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(lambda p: _complete(head.base_url, p), PROMPTS))
    assert _successes(head.base_url, "0") > 0 and _successes(head.base_url, "1") > 0
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(tiny_model_dir), engine="inprocess", kv_cache_memory=16 << 20) as llm:
        outputs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert texts == [output.outputs[0].text for output in outputs]

    # A client with an untrusted key, or with none (plain ZeroMQ), gets no session.
    monkeypatch.setenv(CURVE_KEYS_ENV, str(key_dirs["stranger"]))
    node_key = load_keys(key_dirs["node1"]).public_key.decode()
    with pytest.raises(EngineStartError, match="not ready within"):
        MPEngineClient(address=with_server_key(remote_address, node_key), ready_timeout_s=2.0)
    monkeypatch.delenv(CURVE_KEYS_ENV)
    with pytest.raises(EngineStartError, match="not ready within"):
        MPEngineClient(address=remote_address, ready_timeout_s=2.0)
    assert "refused connections from unauthorized key" in node.log.read_text()

    os.kill(remote_pid, signal.SIGKILL)
    assert [_complete(head.base_url, p) for p in PROMPTS[:2]] == texts[:2]  # engine 0 serves
    assert wait_for(lambda: "engine_core-1 serves again" in node.log.read_text(), 60.0)
    assert wait_for(lambda: "engine 1 serves again" in head.log.read_text(), 15.0)
    before = _successes(head.base_url, "1")
    assert [_complete(head.base_url, p) for p in PROMPTS] == texts
    assert _successes(head.base_url, "1") > before


def test_a_strangers_announcement_is_refused_and_the_head_takes_the_real_rank(
    key_dirs, monkeypatch, caplog
):
    """Row 25: another local user announces rank 1, without CURVE and with a key nobody
    authorized, from before the real host does; the head takes the real host's address only."""
    head_keys, node_keys = load_keys(key_dirs["head"]), load_keys(key_dirs["node1"])
    layout = DataParallelLayout(2, 1, 0, "127.0.0.1", free_ports(1))
    monkeypatch.setattr(dp_hosts, "_probe", lambda address, timeout_s: None)  # no engine here
    caplog.set_level(logging.INFO)
    found: dict[int, str] = {}
    head = threading.Thread(
        target=lambda: found.update(dp_hosts.wait_for_remote_engines(layout, head_keys, 30.0))
    )
    real_address = "tcp://127.0.0.1:1"
    with stranger(layout.announce_address, head_keys.public_key, STRANGER_ANNOUNCE) as uid:
        assert os.geteuid() != 0 or uid != 0, "as root, the stranger runs as another user"
        head.start()
        # The stranger has been refused before the real host says a word.
        assert wait_for(lambda: "unauthorized key" in caplog.text, 10.0), caplog.text
        announcer = EngineAnnouncer(layout, node_keys, {1: real_address})
        announcer.start()
        head.join(30.0)
        announcer.stop()
    assert found == {1: with_server_key(real_address, node_keys.public_key.decode())}
    assert "data-parallel engine 1 is at tcp://127.0.0.1:1" in caplog.text
    assert "tcp://127.0.0.1:9" not in caplog.text


@pytest.mark.parametrize("address", ["127.0.0.1", "10.1.2.3"], ids=["loopback", "public"])
@pytest.mark.parametrize(
    "role", [[], ["--headless", "--data-parallel-start-rank", "1"]], ids=["head", "headless"]
)
def test_data_parallel_ranks_across_hosts_without_keys_are_refused(role, address, monkeypatch):
    """Row 25: even on loopback, where any local user can reach the port, before anything
    starts (exit 2, the message says what to do)."""
    monkeypatch.delenv(CURVE_KEYS_ENV, raising=False)
    command = [*CONVEYOR, "serve", "--frontends", "0", *DP_FLAGS, *role]
    command += ["--data-parallel-address", address]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert f"tcp://{address}:29550 links conveyor processes of several hosts" in result.stderr
    assert "--curve-keys DIR" in result.stderr and "engine_core" not in result.stderr
