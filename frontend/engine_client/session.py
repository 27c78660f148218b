"""A session with an engine: its errors, the liveness check and the handshake (Hello -> Ready).

Runs in the frontend process (an ``LLM`` caller, an HTTP frontend, the supervisor's ready probe).
A client must never hang on an engine that is gone, so each wait is bounded and sliced: between
slices the client asks whether the engine process still exists, and an ``EngineDead`` frame ends
it at once. The handshake is done once, here, on a blocking socket: the async client runs it in a
thread, then drives the same socket from its event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import zmq

from conveyor.protocol import EngineConfig
from conveyor.protocol.codec import CLIENT_TO_ENGINE, ENGINE_TO_CLIENT
from conveyor.protocol.messages import EngineDead, Goodbye, Heartbeat, Hello, Ready
from conveyor.runtime.processes import pid_is_alive
from conveyor.runtime.zmq_security import connect as secure_connect
from conveyor.runtime.zmq_security import keys_from_env

HEARTBEAT_INTERVAL_S = 2.0
# How often a waiting client checks that the engine process still exists.
LIVENESS_INTERVAL_S = 0.25
DEFAULT_READY_TIMEOUT_S = 300.0
HEARTBEAT_FRAME = CLIENT_TO_ENGINE.encode(Heartbeat())
GOODBYE_FRAME = CLIENT_TO_ENGINE.encode(Goodbye())


class EngineDeadError(RuntimeError):
    """The engine is gone (it failed, was killed or shut down); in-flight requests are lost."""


class EngineStartError(RuntimeError):
    """The engine did not become ready: it exited, or did not answer within the timeout."""


class EngineLiveness:
    """Says why the engine is gone, or None while it looks alive.

    ``exit_code`` (our own child: exact and reaps it) takes precedence; otherwise the pid from
    Ready is probed, which only means something on this host (ipc:// or a loopback tcp address).
    """

    def __init__(
        self,
        address: str,
        engine_pid: int | None = None,
        exit_code: Callable[[], int | None] | None = None,
    ) -> None:
        self._exit_code = exit_code
        local = address.startswith(("ipc://", "tcp://127.", "tcp://localhost", "inproc://"))
        self._engine_pid = engine_pid if local else None

    def death_reason(self) -> str | None:
        if self._exit_code is not None:
            code = self._exit_code()
            return None if code is None else f"the engine process exited with code {code}"
        if self._engine_pid is not None and not pid_is_alive(self._engine_pid):
            return f"the engine process {self._engine_pid} is gone"
        return None


def configure_dealer(socket: zmq.Socket) -> None:
    """Options every client's DEALER gets, before it connects."""
    socket.setsockopt(zmq.LINGER, 500)  # long enough for a Goodbye to leave
    # Unbounded queues both ways: a burst of requests must not block (or time out) the sender,
    # and outputs must never be dropped; a dead engine is noticed by the liveness check instead.
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)


def decode_ready_config(ready: Ready) -> EngineConfig:
    return msgspec.msgpack.decode(ready.config_msgpack, type=EngineConfig)


def handshake(
    socket: zmq.Socket, liveness: EngineLiveness, timeout_s: float, client_name: str = ""
) -> Ready:
    """Hello -> Ready on a freshly connected DEALER, bounded and watching the engine process.

    Sending Hello is bounded too: a DEALER with no connection to send on blocks, and under CURVE
    an engine that refuses this client's key leaves it with none, for good (a plain blocking
    send hung such a client forever where the refusal came before the send)."""
    deadline = time.monotonic() + timeout_s
    while not socket.poll(int(LIVENESS_INTERVAL_S * 1000), zmq.POLLOUT):
        _check_start(liveness, deadline, timeout_s)
    socket.send(CLIENT_TO_ENGINE.encode(Hello(client_name)), zmq.NOBLOCK)
    while True:
        if socket.poll(int(LIVENESS_INTERVAL_S * 1000), zmq.POLLIN):
            try:
                message = ENGINE_TO_CLIENT.decode(socket.recv())
            except msgspec.DecodeError:
                continue  # not from a conveyor engine; keep waiting for one
            if isinstance(message, Ready):
                return message
            if isinstance(message, EngineDead):
                raise EngineStartError(f"the engine failed while starting: {message.reason}")
            continue  # outputs for an earlier session of this socket: not ours to keep
        _check_start(liveness, deadline, timeout_s)


def _check_start(liveness: EngineLiveness, deadline: float, timeout_s: float) -> None:
    reason = liveness.death_reason()
    if reason is not None:
        raise EngineStartError(f"{reason} before it was ready")
    if time.monotonic() > deadline:
        raise EngineStartError(f"the engine was not ready within {timeout_s:.0f} s")


def connect(
    context: zmq.Context,
    address: str,
    liveness: EngineLiveness,
    timeout_s: float,
    client_name: str,
) -> tuple[zmq.Socket, Ready]:
    """A DEALER connected to ``address`` that has finished the handshake; closed on failure."""
    dealer = context.socket(zmq.DEALER)
    configure_dealer(dealer)
    try:
        # CURVE over TCP when the user gave keys ($CONVEYOR_CURVE_KEYS).
        secure_connect(dealer, address, keys_from_env())
        return dealer, handshake(dealer, liveness, timeout_s, client_name)
    except BaseException:
        dealer.close(linger=0)
        raise
