"""The engine's socket thread after its own stall, one round at a time (no thread: the test plays
the rounds, so that a stop "lands" exactly where it wants). A stop can fall anywhere in a round;
whatever the thread reads or sweeps first after waking, it must know of the stall before it."""

from __future__ import annotations

import logging
import queue
import time
from pathlib import Path

import pytest
import zmq

from conveyor.engine_core.client_io import ClientGone, ClientIO
from conveyor.protocol.codec import CLIENT_TO_ENGINE
from conveyor.protocol.messages import Goodbye, Heartbeat, Hello

TIMEOUT_S = 3.0


@pytest.fixture
def io_and_dealer(tmp_path: Path):
    inputs: queue.Queue = queue.Queue()
    io = ClientIO(f"ipc://{tmp_path}/engine.sock", b"", inputs, heartbeat_timeout_s=TIMEOUT_S)
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(io.address)
    try:
        yield io, dealer, inputs
    finally:
        dealer.close(linger=0)
        context.term()
        io.stop()


def _deliver(io: ClientIO, dealer: zmq.Socket, *messages: object) -> None:
    for message in messages:
        dealer.send(CLIENT_TO_ENGINE.encode(message))
    # Let the frames reach the ROUTER before the round reads them.
    assert io._router.poll(5000, zmq.POLLIN)
    time.sleep(0.05)
    io._receive_some()


def _stalled(io: ClientIO, seconds: float) -> None:
    """As if the process had been stopped for ``seconds`` since the thread last looked."""
    io._last_ran -= seconds
    for client in io.registry._by_identity.values():
        client.last_seen -= seconds


def test_a_goodbye_read_first_after_a_stall_comes_after_the_stall_is_known(io_and_dealer, caplog):
    io, dealer, inputs = io_and_dealer
    _deliver(io, dealer, Hello("frontend"))
    assert len(io.registry) == 1
    _stalled(io, 2 * TIMEOUT_S)
    with caplog.at_level(logging.INFO, logger="conveyor.engine_core.client_io"):
        _deliver(io, dealer, Goodbye())
    messages = [r.getMessage() for r in caplog.records]
    stall = [i for i, m in enumerate(messages) if "did not run for" in m]
    goodbye = [i for i, m in enumerate(messages) if "said goodbye" in m]
    assert len(stall) == 1 and len(goodbye) == 1 and stall[0] < goodbye[0], messages
    gone = inputs.get_nowait()
    assert isinstance(gone, ClientGone) and gone.reason == "goodbye"


def test_a_sweep_right_after_a_stall_drops_nobody(io_and_dealer):
    io, dealer, inputs = io_and_dealer
    _deliver(io, dealer, Hello("a"))
    _stalled(io, 2 * TIMEOUT_S)
    io._drop_silent_clients()
    assert len(io.registry) == 1 and inputs.empty()
    # The clock runs on without the client: its own silence still counts.
    for client in io.registry._by_identity.values():
        client.last_seen -= 2 * TIMEOUT_S
    io._drop_silent_clients()
    assert len(io.registry) == 0
    assert inputs.get_nowait().reason == "heartbeat timeout"


def test_without_a_stall_nothing_is_forgiven(io_and_dealer, caplog):
    io, dealer, _ = io_and_dealer
    _deliver(io, dealer, Hello("a"))
    with caplog.at_level(logging.INFO, logger="conveyor.engine_core.client_io"):
        _deliver(io, dealer, Heartbeat())
    assert not [r for r in caplog.records if "did not run for" in r.getMessage()]
