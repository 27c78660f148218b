"""CURVE on TCP sockets between processes: key folders, who may connect, and the rule that no
address other hosts can reach is bound (or connected) without keys.

Runs in the test process; every socket is on 127.0.0.1 and every wait is bounded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq

from conveyor.engine_core.core_process import find_address_problem
from conveyor.entrypoints.keys import main as keys_main
from conveyor.executor.worker_processes import WorkerProcesses
from conveyor.protocol.config import NodeConfig
from conveyor.runtime.zmq_security import (
    CURVE_KEYS_ENV,
    CurveKeys,
    CurveKeysError,
    InsecureAddressError,
    SecureBinder,
    check_address,
    connect,
    faces_network,
    generate_keys,
    keys_from_env,
    load_keys,
)
from tests.curve_keys import trusted_key_dirs


@pytest.fixture
def key_dirs(tmp_path: Path) -> dict[str, Path]:
    """Three hosts' key folders: the head and node 1 trust each other; the stranger is trusted
    by nobody (it knows the head's public key, as anyone may)."""
    return trusted_key_dirs(tmp_path)


def test_a_key_folder_holds_a_private_pair_and_names_the_head(key_dirs):
    head, node1 = load_keys(key_dirs["head"]), load_keys(key_dirs["node1"])
    assert (key_dirs["head"] / "node.key_secret").stat().st_mode & 0o777 == 0o600
    assert head.head_key == head.public_key  # the head checks its own servers by its own key
    assert node1.head_key == head.public_key
    assert head.allows(node1.public_key) and head.allows(head.public_key)
    assert not head.allows(load_keys(key_dirs["stranger"]).public_key)
    assert head.secret_key.decode() not in repr(head)  # never printed by accident


def test_a_key_folder_is_never_overwritten_or_used_when_others_can_read_it(key_dirs):
    with pytest.raises(CurveKeysError, match="already holds"):
        generate_keys(key_dirs["head"])
    (key_dirs["head"] / "node.key_secret").chmod(0o644)
    with pytest.raises(CurveKeysError, match="readable by other users"):
        load_keys(key_dirs["head"])
    with pytest.raises(CurveKeysError, match="conveyor keys generate"):
        load_keys(key_dirs["head"] / "authorized")


def test_the_keys_command_generates_and_shows(tmp_path, capsys):
    assert keys_main(["generate", str(tmp_path / "k")]) == 0
    assert keys_main(["show", str(tmp_path / "k")]) == 0
    public = load_keys(tmp_path / "k").public_key.decode()
    assert f"this host: {public}" in capsys.readouterr().out
    assert keys_main(["generate", str(tmp_path / "k")]) == 2  # refuses to overwrite


def test_keys_come_from_the_environment_by_path(key_dirs):
    assert keys_from_env({}) is None
    keys = keys_from_env({CURVE_KEYS_ENV: str(key_dirs["node1"])})
    assert isinstance(keys, CurveKeys) and keys == load_keys(key_dirs["node1"])


@pytest.mark.parametrize(
    ("address", "network"),
    [
        ("ipc:///tmp/x.sock", False),
        ("tcp://127.0.0.1:5555", False),
        ("tcp://127.1.2.3:5555", False),
        ("tcp://localhost:5555", False),
        ("tcp://[::1]:5555", False),
        ("tcp://0.0.0.0:5555", True),
        ("tcp://*:5555", True),
        ("tcp://10.1.2.3:5555", True),
        ("tcp://[2001:db8::1]:5555", True),
        ("tcp://example.org:5555", True),
    ],
)
def test_an_address_off_loopback_needs_keys(address, network, key_dirs):
    assert faces_network(address) == network
    if network:
        with pytest.raises(InsecureAddressError, match="no CURVE keys"):
            check_address(address, None)
    else:
        check_address(address, None)
    check_address(address, load_keys(key_dirs["head"]))


def test_the_engine_binds_off_loopback_only_when_allowed_and_with_keys(key_dirs):
    keys = load_keys(key_dirs["head"])
    assert find_address_problem("tcp://127.0.0.1:5555") is None
    assert "allow remote clients" in find_address_problem("tcp://10.1.2.3:5555", keys=keys)
    refused = find_address_problem("tcp://10.1.2.3:5555", allow_remote_clients=True)
    assert "no CURVE keys" in refused
    assert find_address_problem("tcp://10.1.2.3:5555", True, keys) is None


@pytest.mark.parametrize("address", ["127.0.0.1", "10.1.2.3"])
def test_workers_on_other_hosts_are_refused_without_keys_even_on_loopback(address, monkeypatch):
    monkeypatch.delenv(CURVE_KEYS_ENV, raising=False)
    nodes = NodeConfig(nnodes=2, master_addr=address, master_port=29500)
    with pytest.raises(InsecureAddressError, match=f"tcp://{address}:29501 links conveyor"):
        WorkerProcesses(2, nodes)


def _delivered(server: zmq.Socket, address: str, keys: CurveKeys | None) -> bool:
    """Does a frame from a client holding ``keys`` reach ``server``?"""
    client = zmq.Context.instance().socket(zmq.PUSH)
    try:
        if keys is None:
            client.connect(address)  # no CURVE at all
        else:
            connect(client, address, keys)
        client.send(b"hello", zmq.NOBLOCK)
        return bool(server.poll(1000)) and server.recv() == b"hello"
    except zmq.Again:
        return False  # never even connected: the handshake failed
    finally:
        client.close(linger=0)


def test_only_an_authorized_client_gets_through(key_dirs):
    context = zmq.Context()
    binder = SecureBinder(context, load_keys(key_dirs["head"]))
    server = context.socket(zmq.PULL)
    server.setsockopt(zmq.LINGER, 0)
    try:
        binder.bind(server, "tcp://127.0.0.1:0")
        address = server.getsockopt(zmq.LAST_ENDPOINT).decode()
        assert not _delivered(server, address, load_keys(key_dirs["stranger"]))
        assert not _delivered(server, address, None)
        assert _delivered(server, address, load_keys(key_dirs["node1"]))
        assert _delivered(server, address, load_keys(key_dirs["head"]))  # this host's own
    finally:
        server.close()
        binder.close()
        context.term()


def test_a_client_whose_key_the_engine_refuses_gets_an_error_in_time_not_a_hang(key_dirs):
    # Its DEALER never gets a connection to send on: the handshake's Hello must not block.
    import time

    from conveyor.frontend.engine_client.session import EngineLiveness, EngineStartError, handshake

    context = zmq.Context()
    binder = SecureBinder(context, load_keys(key_dirs["head"]))
    server = context.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    client = context.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    try:
        binder.bind(server, "tcp://127.0.0.1:0")
        address = server.getsockopt(zmq.LAST_ENDPOINT).decode()
        connect(client, address, load_keys(key_dirs["stranger"]))
        # Until the refusal has taken the connection away (the race a plain blocking send lost).
        gone_by = time.monotonic() + 5.0
        while client.poll(0, zmq.POLLOUT) and time.monotonic() < gone_by:
            time.sleep(0.02)
        assert not client.poll(0, zmq.POLLOUT), "the engine never refused the stranger's key"
        started = time.monotonic()
        with pytest.raises(EngineStartError, match="not ready within 1 s"):
            handshake(client, EngineLiveness(address), 1.0)
        assert time.monotonic() - started < 3.0
    finally:
        client.close()
        server.close()
        binder.close()
        context.term()
