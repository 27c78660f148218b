"""The base of both ZMQ engine clients: start or attach, one socket thread, and the meaning of
every frame from the engine, written once.

Runs in the frontend process. The blocking ``MPEngineClient`` (``sync_client``) and the asyncio
``AsyncEngineClient`` (``async_client``) differ only in where a message is acted on (the socket
thread itself, or the event loop) and how callers wait; the handshake is ``session``'s.

One thread owns the DEALER socket (ZMQ sockets are single-threaded): it forwards the frames
callers encode (through an inproc pipe, which never blocks them), decodes what the engine sends,
heartbeats, and checks that the engine process still exists. Heartbeats come from this thread,
not from the caller's event loop, so a busy loop cannot starve them; an async client lets them go
out only while its loop still answers (``responsive``), so the engine drops a frontend only when
it is really stuck, never for a long request. The engine answers each heartbeat: an engine that
answers none for the silence limit (``SILENCE_HEARTBEATS`` heartbeats by default) is gone, even
where its pid cannot be watched (an engine on another host that vanished, a stalled one). Such a
session ends with a Goodbye, so that an engine that was only stalled aborts its requests when it
wakes; the client says when it last heard the engine (``unheard_since``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable

import zmq

from conveyor.frontend.engine_client.engine_process import EngineProcess
from conveyor.frontend.engine_client.session import (
    GOODBYE_FRAME,
    HEARTBEAT_FRAME,
    LIVENESS_INTERVAL_S,
    EngineDeadError,
    EngineLiveness,
    decode_ready_config,
)
from conveyor.protocol import EngineConfig, EngineCoreOutputs, SchedulerStats
from conveyor.protocol.codec import CLIENT_TO_ENGINE, ENGINE_TO_CLIENT
from conveyor.protocol.messages import (
    AllFreeReport,
    EngineCoreClientMessage,
    EngineDead,
    EngineOutputsFrame,
    Ready,
)

logger = logging.getLogger(__name__)

_STOP_FRAME = b""  # never a real message: every encoded message has at least one byte
_pipe_names = itertools.count()

EngineMessage = EngineOutputsFrame | AllFreeReport | EngineDead
# Heartbeats in a row the engine may leave unanswered before it counts as gone (10 s by default).
SILENCE_HEARTBEATS = 5


def launch_engine(
    config: EngineConfig | None,
    address: str | None,
    executor_backend: str | None,
    heartbeat_timeout_s: float | None,
) -> tuple[EngineProcess | None, str, EngineLiveness]:
    """Start an engine from ``config`` (the caller owns it), or prepare to attach at ``address``.

    Call from a long-lived thread: the engine's parent-death signal follows the thread that
    forked it. Returns the engine (or None), the address, and how to tell it died before Ready.
    """
    if (config is None) == (address is None):
        raise ValueError("give either a config (start an engine) or an address (attach)")
    if config is None:
        assert address is not None
        return None, address, EngineLiveness(address)
    engine = EngineProcess(config, executor_backend, heartbeat_timeout_s).start()
    return engine, engine.address, engine.liveness()


# Heartbeats per engine timeout at least: three may be late (a loaded machine, a slow start) and
# the engine still hears the fourth in time.
HEARTBEATS_PER_TIMEOUT = 4


def heartbeat_interval(requested_s: float, engine_timeout_s: float) -> float:
    """``requested_s``, or shorter where the engine said it drops a client sooner: a client
    heartbeating every 2 s to an engine that waits 3 s is dropped by one late heartbeat."""
    if engine_timeout_s <= 0:
        return requested_s
    return min(requested_s, engine_timeout_s / HEARTBEATS_PER_TIMEOUT)


class EngineClientBase(ABC):
    """The state and frame handling both ZMQ clients share, after a successful handshake.

    Subclasses say what an output batch, a report and the engine's death mean to their callers
    (``_on_outputs``, ``_on_report``, ``_on_dead``); everything else is here once.
    """

    def __init__(
        self, address: str, ready: Ready, engine: EngineProcess | None, client_name: str
    ) -> None:
        self.address = address
        self.client_name = client_name
        self.client_index = ready.client_index
        self.engine_pid = ready.engine_pid
        self.engine_index = ready.engine_index
        self.engine_heartbeat_timeout_s = ready.heartbeat_timeout_s
        self.config: EngineConfig = decode_ready_config(ready)
        self._engine = engine
        # Our own engine is watched exactly (its exit code); an attached one by its pid.
        self._liveness = engine.liveness() if engine else EngineLiveness(address, ready.engine_pid)
        self.dead_reason: str | None = None
        self.session_lost = False
        # Set once our own shutdown began: what follows is no news to an operator.
        self.closing = False
        # The engine's latest scheduler stats, from the last outputs this client received (the
        # engine also sends them to every client once a second while it works).
        self.stats: SchedulerStats | None = None

    @property
    def unheard_since(self) -> float | None:
        """When the engine was last heard from (``time.monotonic()``), if its silence is what
        ended the session; None while it serves, or when it ended otherwise."""
        return self._io.last_heard if self._io.went_silent else None

    @abstractmethod
    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        """An output batch for this client (called on the thread or loop that reads frames)."""

    @abstractmethod
    def _on_report(self, report: AllFreeReport) -> None:
        """The engine's answer to a CheckAllFree query."""

    @abstractmethod
    def _on_dead(self, error: EngineDeadError) -> None:
        """The engine is gone (or dropped us): fail whatever waits on it."""

    def _handle_message(self, message: EngineMessage) -> None:
        """Act on one message from the engine (where the subclass delivers it)."""
        if isinstance(message, EngineOutputsFrame):
            outputs = message.outputs
            if outputs.scheduler_stats is not None:
                self.stats = outputs.scheduler_stats
            if outputs.outputs:  # else the engine's periodic stats alone: nothing to deliver
                self._on_outputs(outputs)
        elif isinstance(message, AllFreeReport):
            self._on_report(message)
        elif isinstance(message, EngineDead):
            self._mark_dead(
                message.reason, session_lost=message.client_dropped, shutdown=message.shutdown
            )

    # ------------------------------------------------------------------ the socket thread

    def _start_io(
        self,
        context: zmq.Context,
        dealer: zmq.Socket,
        heartbeat_interval_s: float,
        deliver: Callable[[EngineMessage], None],
        on_death: Callable[[str], None],
        responsive: Callable[[], bool] = lambda: True,
        silence_limit_s: float | None = None,
    ) -> None:
        """Hand ``dealer`` (handshake done) to a socket thread; from now on send with ``_send``.

        ``deliver`` and ``on_death`` are called on the socket thread: they act there or pass
        the news on to where the client's state lives. ``silence_limit_s``: how long an engine
        may answer no heartbeat before it counts as gone (None: ``SILENCE_HEARTBEATS`` of the
        requested interval).
        """
        self._context = context
        if silence_limit_s is None:
            # Stays with the requested interval: heartbeating more often for a strict engine
            # must not make this side quicker to give up on it.
            silence_limit_s = SILENCE_HEARTBEATS * heartbeat_interval_s
        beat_s = heartbeat_interval(heartbeat_interval_s, self.engine_heartbeat_timeout_s)
        self._io = SocketThread(
            context, dealer, self._liveness, beat_s, silence_limit_s, deliver, on_death, responsive
        )
        self._sender = context.socket(zmq.PUSH)
        self._sender.setsockopt(zmq.SNDHWM, 0)
        self._sender.connect(self._io.pipe_address)
        self._send_lock = threading.Lock()
        self._io.start()

    def _send(self, message: EngineCoreClientMessage) -> None:
        """Queue a message for the engine; never blocks. ``EngineDeadError`` once it is gone."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        try:
            with self._send_lock:
                self._sender.send(CLIENT_TO_ENGINE.encode(message), zmq.NOBLOCK)
        except zmq.ZMQError:
            # The socket thread has stopped (its end of the pipe is gone): so has the engine.
            raise EngineDeadError(self.dead_reason or "the client stopped") from None

    def _stop_io(self, timeout_s: float = 5.0) -> None:
        """Stop the socket thread (after what was queued went out) and release the sockets."""
        if self._io.is_alive():
            with self._send_lock, contextlib.suppress(zmq.ZMQError):
                self._sender.send(_STOP_FRAME, zmq.NOBLOCK)
        self._io.join(timeout_s)
        with self._send_lock:
            self._sender.close(linger=0)
        if not self._io.is_alive():
            # Waits out the DEALER's linger: a Goodbye queued just before still leaves.
            self._context.term()

    def _mark_dead(
        self, reason: str, *, session_lost: bool = False, shutdown: bool = False
    ) -> None:
        """The session is over: ``session_lost`` (the engine dropped us) or ``shutdown`` (the
        engine was stopped on purpose) or, with neither, the engine failed."""
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        self.session_lost = session_lost
        if self.closing or (shutdown and self._engine is not None):
            # Our own shutdown, or our own engine stopped by us (an LLM's finalizer): routine.
            logger.info("engine session closed: %s", reason)
        elif shutdown:
            logger.warning("the engine shut down: %s; this client can no longer serve", reason)
        elif session_lost:
            logger.error("engine session lost: %s", reason)
        else:
            logger.error("engine dead: %s", reason)
        self._on_dead(EngineDeadError(reason))


class SocketThread(threading.Thread):
    """Owns a client's DEALER: forwards the caller's frames, decodes the engine's, heartbeats,
    and watches the engine process."""

    def __init__(
        self,
        context: zmq.Context,
        dealer: zmq.Socket,
        liveness: EngineLiveness,
        heartbeat_interval_s: float,
        silence_limit_s: float,
        deliver: Callable[[EngineMessage], None],
        on_death: Callable[[str], None],
        responsive: Callable[[], bool],
    ) -> None:
        super().__init__(name="engine-client-io", daemon=True)
        self._dealer = dealer
        self.pipe_address = f"inproc://engine-client-{next(_pipe_names)}"
        self._pipe = context.socket(zmq.PULL)
        self._pipe.setsockopt(zmq.RCVHWM, 0)
        self._pipe.bind(self.pipe_address)
        self._liveness = liveness
        self._heartbeat_interval_s = heartbeat_interval_s
        self._deliver = deliver
        self._on_death = on_death
        self._responsive = responsive
        self.silence_limit_s = silence_limit_s
        # When the oldest heartbeat the engine has not answered (nor sent anything since) left.
        self._unanswered_since: float | None = None
        self._last_round = time.monotonic()
        # When the engine last sent anything (the handshake's Ready counts), and whether its
        # silence ended the session: read by the client's owner while it attaches again.
        self.last_heard = self._last_round
        self.went_silent = False

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._dealer, zmq.POLLIN)
        poller.register(self._pipe, zmq.POLLIN)
        next_heartbeat = time.monotonic() + self._heartbeat_interval_s
        try:
            while True:
                events = dict(poller.poll(int(LIVENESS_INTERVAL_S * 1000)))
                if self._pipe in events and not self._forward():
                    return
                if self._dealer in events and not self._receive():
                    return
                if time.monotonic() >= next_heartbeat:
                    next_heartbeat = time.monotonic() + self._heartbeat_interval_s
                    self._heartbeat()
                reason = self._liveness.death_reason() or self._silence()
                if reason is not None:
                    self._on_death(reason)
                    return
        except Exception as exc:  # a bug here must surface to the callers, not hang them
            logger.exception("engine client socket thread failed")
            self._on_death(f"the client's socket thread failed: {exc!r}")
        finally:
            self._dealer.close()
            self._pipe.close(linger=0)

    def _heartbeat(self) -> None:
        if not self._responsive():
            # We are the stalled side: the engine's silence since proves nothing.
            self._unanswered_since = None
            return
        self._dealer.send(HEARTBEAT_FRAME)
        if self._unanswered_since is None:
            self._unanswered_since = time.monotonic()

    def _silence(self) -> str | None:
        """Why the engine counts as gone for not answering our heartbeats, or None."""
        now = time.monotonic()
        if now - self._last_round > max(self.silence_limit_s / 2, 4 * LIVENESS_INTERVAL_S):
            # This thread did not run for a while (a stopped or starved process): the engine
            # had no chance to be heard; start counting again.
            self._unanswered_since = None
        self._last_round = now
        since = self._unanswered_since
        if since is None or now - since <= self.silence_limit_s:
            return None
        self.went_silent = True
        # A stalled engine (stopped, swapped out) reads this when it wakes, and aborts this
        # session's requests at once instead of running them for nobody until it drops us.
        with contextlib.suppress(zmq.ZMQError):
            self._dealer.send(GOODBYE_FRAME, zmq.NOBLOCK)
        return f"the engine answered no heartbeat for {now - since:.1f} s"

    def _forward(self) -> bool:
        """Send the caller's frames on; False at the stop frame."""
        while True:
            try:
                frame = self._pipe.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            if frame == _STOP_FRAME:
                return False
            self._dealer.send(frame)

    def _receive(self) -> bool:
        """Decode and deliver the engine's frames; False once the engine said it is dead."""
        while True:
            try:
                frame = self._dealer.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            self._unanswered_since = None  # any frame: the engine is there
            self.last_heard = time.monotonic()
            try:
                message = ENGINE_TO_CLIENT.decode(frame)
            except Exception as exc:
                logger.warning("dropped an undecodable frame from the engine: %s", exc)
                continue
            if isinstance(message, (EngineOutputsFrame, AllFreeReport, EngineDead)):
                self._deliver(message)
            if isinstance(message, EngineDead):
                return False
