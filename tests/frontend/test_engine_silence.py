"""An engine that stops answering heartbeats is gone to its clients, even when its pid lives (an
engine on another host, whose pid no client can watch, or a stalled one).

Runs in the test process: a fake engine (a ROUTER that answers Hello with Ready, and heartbeats
only when told to) in a thread, and a real ``MPEngineClient`` with a fast heartbeat.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from conveyor.frontend.engine_client import MPEngineClient
from conveyor.frontend.engine_client.core_client import SILENCE_HEARTBEATS
from conveyor.protocol.codec import CLIENT_TO_ENGINE, ENGINE_TO_CLIENT
from conveyor.protocol.messages import EngineHeartbeat, Heartbeat, Hello, Ready
from tests.multiproc_helpers import make_config

INTERVAL_S = 0.25  # a silence limit of 1.25 s: a loaded 2-core host stalls a thread for 0.5 s


class FakeEngine(threading.Thread):
    def __init__(self, address: str, config_msgpack: bytes, answers: bool) -> None:
        super().__init__(daemon=True)
        self.context = zmq.Context()
        self.router = self.context.socket(zmq.ROUTER)
        self.router.bind(address)
        self.config_msgpack = config_msgpack
        self.answers = answers
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            if not self.router.poll(50):
                continue
            identity, frame = self.router.recv_multipart()
            message = CLIENT_TO_ENGINE.decode(frame)
            if isinstance(message, Hello):
                # Our own pid: alive throughout, so only the heartbeats can tell.
                reply = Ready(0, self.config_msgpack, os.getpid())
            elif isinstance(message, Heartbeat) and self.answers:
                reply = EngineHeartbeat()
            else:
                continue
            self.router.send_multipart([identity, ENGINE_TO_CLIENT.encode(reply)])
        self.router.close(linger=0)
        self.context.term()


@pytest.mark.parametrize("answers", [True, False])
def test_a_client_gives_up_on_an_engine_that_answers_no_heartbeat(
    answers, tiny_model_dir: Path, tmp_path: Path
):
    address = f"ipc://{tmp_path / 'engine.sock'}"
    engine = FakeEngine(address, msgspec.msgpack.encode(make_config(tiny_model_dir)), answers)
    engine.start()
    client = MPEngineClient(address=address, heartbeat_interval_s=INTERVAL_S, ready_timeout_s=5)
    try:
        time.sleep(3 * SILENCE_HEARTBEATS * INTERVAL_S)
        if answers:
            assert client.dead_reason is None
        else:
            assert client.dead_reason is not None
            assert "answered no heartbeat for" in client.dead_reason
    finally:
        client.shutdown()
        engine.stopped.set()
        engine.join(5.0)
