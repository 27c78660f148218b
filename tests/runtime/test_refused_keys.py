"""Refused CURVE keys: every refusal counted, a bounded number of keys remembered, the log
written at a bounded rate (reliability row 25), whatever the number of keys a stranger tries.

Runs in the test process; every socket is on 127.0.0.1 and every wait is bounded.
"""

from __future__ import annotations

import logging
import time
import tracemalloc
from pathlib import Path

import zmq

from conveyor.runtime.refused_keys import RefusedKeys
from conveyor.runtime.zmq_security import CurveKeys, SecureBinder, generate_keys, load_keys

NUM_KEYS = 1000
BATCH = 100


def _lines(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records]


def test_keys_are_named_a_few_per_interval_and_the_rest_counted(caplog):
    now = [0.0]
    refused = RefusedKeys(capacity=4, named_per_interval=2, interval_s=60.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING)
    for key in [b"k1", b"k1", b"k2", b"k3", b"k4", b"k5"]:
        refused.add(key)
    assert _lines(caplog) == [
        "refused connections from unauthorized key k1",
        "refused connections from unauthorized key k2",
    ]  # k1's retry is counted, not logged; k3-k5 wait for the interval's count
    assert (refused.num_refused, refused.num_new_keys, refused.num_remembered) == (6, 5, 4)
    caplog.clear()
    now[0] = 60.0
    refused.add(b"k5")  # a retry: the interval is over, so its count comes out now
    refused.add(b"k6")  # a new interval names keys again: a new host is not hidden for good
    assert _lines(caplog) == [
        "refused connections from 3 more unauthorized keys, not named (at most 2 are named per "
        "60 s); 7 connections refused in all",
        "refused connections from unauthorized key k6",
    ]
    caplog.clear()
    refused.flush()
    assert _lines(caplog) == []  # nothing left unsaid
    assert refused.num_remembered == 4  # k1 went first: the least recently refused


def _refuse_random_keys(binder: SecureBinder, address: str, server_key: bytes, count: int) -> None:
    """``count`` clients, each with a key of its own, until ZAP has refused every one."""
    context = zmq.Context.instance()
    wanted = binder.refused.num_new_keys + count
    clients = []
    for _ in range(count):
        client = context.socket(zmq.PUSH)
        client.setsockopt(zmq.LINGER, 0)
        client.curve_publickey, client.curve_secretkey = zmq.curve_keypair()
        client.curve_serverkey = server_key
        client.connect(address)
        clients.append(client)
    deadline = time.monotonic() + 30.0
    while binder.refused.num_new_keys < wanted and time.monotonic() < deadline:
        time.sleep(0.005)
    for client in clients:
        client.close()
    assert binder.refused.num_new_keys >= wanted, "ZAP never saw some of the clients"


def test_a_thousand_refused_keys_give_a_bounded_log_and_flat_memory(tmp_path: Path, caplog):
    generate_keys(tmp_path / "head")
    keys: CurveKeys = load_keys(tmp_path / "head")
    context = zmq.Context()
    binder = SecureBinder(context, keys)
    server = context.socket(zmq.PULL)
    server.setsockopt(zmq.LINGER, 0)
    caplog.set_level(logging.DEBUG)  # pyzmq's per-request ZAP lines must not show even here
    tracemalloc.start()
    try:
        binder.bind(server, "tcp://127.0.0.1:0")
        address = server.getsockopt(zmq.LAST_ENDPOINT).decode()
        memory = []
        for _ in range(NUM_KEYS // BATCH):
            _refuse_random_keys(binder, address, keys.public_key, BATCH)
            memory.append(tracemalloc.get_traced_memory()[0])
        assert not server.poll(0), "a refused client got a frame through"
    finally:
        tracemalloc.stop()
        server.close()
        binder.close()  # logs the count of the keys it did not name
        context.term()
    refused = binder.refused
    assert refused.num_refused >= NUM_KEYS and refused.num_new_keys >= NUM_KEYS
    assert refused.num_remembered == refused.capacity
    lines = _lines(caplog)
    named = [line for line in lines if line.startswith("refused connections from unauthorized")]
    assert len(named) == refused.named_per_interval
    assert len(lines) <= refused.named_per_interval + 2, lines  # one count (two: a minute passed)
    assert f"{refused.num_refused} connections refused in all" in lines[-1]
    # Flat once the remembered keys are at their bound: the second half added nothing that
    # stays (a remembered key costs about 100 bytes; 500 more would be about 50 KB).
    assert memory[-1] - memory[len(memory) // 2 - 1] < 16 * 1024, memory
