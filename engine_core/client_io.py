"""The engine core's socket thread: every frontend's frames in, every output frame out.

Runs in the engine-core process, as one thread that alone owns the ROUTER socket (ZMQ sockets are
not thread-safe, and a ROUTER must receive and send from the same thread). It decodes client
frames and hands requests and aborts to the busy loop through a queue; the busy loop hands outputs
back through another queue plus a wake-up pipe the thread polls beside the socket, so the loop
never touches the socket and the thread never blocks the loop. Session traffic (Hello, Heartbeat,
Goodbye; each Heartbeat gets an ``EngineHeartbeat`` back, by which a client on another host knows
we are there) is answered here without the busy loop, and so is any frame from a client that is not
attached (dropped for silence, say): an ``EngineDead`` for that client alone. A frame that does
not decode is logged and dropped: one bad client must not stop the engine for everyone. A client
is dropped for its own silence only: when this thread itself did not run for a while (the process
was stopped, swapped out, its VM paused), nobody could have been heard, so every client gets a
whole timeout again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Union

import msgspec
import zmq

from conveyor.engine_core.client_registry import ClientRegistry
from conveyor.protocol import (
    Abort,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
)
from conveyor.protocol.codec import CLIENT_TO_ENGINE, ENGINE_TO_CLIENT
from conveyor.protocol.messages import (
    AddRequests,
    AllFreeReport,
    CheckAllFree,
    EngineCoreServerMessage,
    EngineDead,
    EngineHeartbeat,
    EngineOutputsFrame,
    Goodbye,
    Heartbeat,
    Hello,
    Ready,
)
from conveyor.runtime.zmq_security import SecureBinder, keys_from_env

logger = logging.getLogger(__name__)

_POLL_MS = 200
_MAX_FRAMES_PER_ROUND = 512  # then look at outgoing work, so a flood cannot starve outputs
_LINGER_MS = 1000  # on close, how long queued frames (an EngineDead) may take to leave
# The longest request id an unreadable request is answered under (a client's ids are short).
MAX_ANSWERED_ID_CHARS = 256
_REQUEST_TAG = EngineCoreRequest.__struct_config__.tag
_ADD_REQUESTS_TAG = AddRequests.__struct_config__.tag
_REQUEST_DECODER = msgspec.msgpack.Decoder(EngineCoreRequest)
_HEARTBEAT_FRAME = ENGINE_TO_CLIENT.encode(EngineHeartbeat())


@dataclass(frozen=True)
class ClientInput:
    """A request or an abort from an attached client, for the busy loop."""

    client_index: int
    message: Union[EngineCoreRequest, Abort, CheckAllFree]


@dataclass(frozen=True)
class ClientGone:
    """A client said Goodbye or went silent: the busy loop aborts its requests."""

    client_index: int
    reason: str


@dataclass(frozen=True)
class IOFailed:
    """The socket thread hit an unexpected error: the engine can no longer talk; it must exit."""

    reason: str


# None asks the busy loop to return.
BusyLoopInput = Union[ClientInput, ClientGone, IOFailed, None]

_STOP = object()


@dataclass(frozen=True)
class _StatsForAll:
    stats: SchedulerStats


class ClientIO:
    """Binds the ROUTER at construction (so a bad address fails at once); ``start`` runs it."""

    def __init__(
        self,
        address: str,
        ready_config_msgpack: bytes,
        inputs: queue.Queue[BusyLoopInput],
        heartbeat_timeout_s: float,
        engine_index: int = 0,
    ) -> None:
        self._context = zmq.Context()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, _LINGER_MS)
        # No high-water mark on sends: at the default (1000 frames) a ROUTER silently drops a
        # slow client's outputs, and that client would wait forever for a finish it never gets.
        # What bounds the backlog is the heartbeat: a client that stops reading also stops
        # heartbeating (one thread or one loop does both) and is dropped.
        self._router.setsockopt(zmq.SNDHWM, 0)
        # A CURVE server over TCP when the user gave keys: only authorized clients get in.
        self._binder = SecureBinder(self._context, keys_from_env())
        self._binder.bind(self._router, address)
        self.address: str = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._config_msgpack = ready_config_msgpack
        self._engine_index = engine_index
        # The stats last sent to every client: a client that attaches gets them after Ready.
        self._latest_stats_frame: bytes | None = None
        self._inputs = inputs
        self.registry = ClientRegistry(heartbeat_timeout_s)
        # A gap between two rounds of this thread longer than this is our stall, not the
        # clients' silence. Half the timeout: a client last heard one heartbeat before a
        # shorter gap still has time to be heard after it (clients beat four times a timeout).
        self._stall_limit_s = max(heartbeat_timeout_s / 2, 5 * _POLL_MS / 1000)
        self._last_ran = time.monotonic()
        self._outgoing: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self.num_dropped_frames = 0
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="engine-io", daemon=True)

    # ------------------------------------------------------------------ any thread

    def start(self) -> None:
        self._thread.start()

    def send_outputs(self, client_index: int, outputs: EngineCoreOutputs) -> None:
        self._put((client_index, outputs))

    def send_report(self, client_index: int, report: AllFreeReport) -> None:
        self._put((client_index, report))

    def broadcast_engine_dead(self, reason: str, shutdown: bool = False) -> None:
        self._put(EngineDead(reason, shutdown=shutdown))

    def broadcast_stats(self, stats: SchedulerStats) -> None:
        """The scheduler's stats for every attached client, outputs or not."""
        self._put(_StatsForAll(stats))

    def stop(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (an EngineDead included), then close; bounded by ``timeout_s``."""
        if self._stopped:
            return
        if self._thread.is_alive():
            self._put(_STOP)
            self._thread.join(timeout_s)
        elif self._thread.ident is None:  # never started
            self._close_socket()
        self._stopped = True
        if not self._thread.is_alive():
            # Only now: a closed fd number can be reused at once, and a late write would land there.
            os.close(self._wake_read)
            os.close(self._wake_write)

    def _put(self, item: object) -> None:
        if self._stopped:
            return
        self._outgoing.put(item)
        # A full pipe means wake-ups are pending already: the thread will look.
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_write, b"\x00")

    # ------------------------------------------------------------------ the socket thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        next_expiry_check = self._last_ran = time.monotonic()
        try:
            while True:
                events = dict(poller.poll(_POLL_MS))
                self._forgive_own_stall()
                if self._router in events:
                    self._receive_some()
                if self._wake_read in events and not self._send_queued():
                    return
                if time.monotonic() >= next_expiry_check:
                    self._drop_silent_clients()
                    next_expiry_check = time.monotonic() + _POLL_MS / 1000
        except Exception as exc:  # a bug here must end the engine, not leave it deaf
            logger.exception("engine socket thread failed")
            self._inputs.put(IOFailed(f"engine socket thread failed: {exc!r}"))
        finally:
            self._close_socket()

    def _forgive_own_stall(self) -> None:
        """Give every client a whole timeout again if this thread has not run for longer than
        the stall limit since it last looked. It looks before each frame and before each sweep
        for silent clients, not once a round: a stop can land anywhere in a round, and the
        frames read after it (a Goodbye, a heartbeat) must not be handled, nor clients
        dropped, before the stall is known."""
        now = time.monotonic()
        if now - self._last_ran > self._stall_limit_s and len(self.registry):
            logger.warning(
                "the engine did not run for %.1f s (stopped or starved): no client could be "
                "heard meanwhile; each gets %g s from now",
                now - self._last_ran,
                self.registry.heartbeat_timeout_s,
            )
            self.registry.hear_all()
        self._last_ran = now

    def _close_socket(self) -> None:
        self._router.close(linger=_LINGER_MS)
        self._binder.close()
        self._context.term()

    def _receive_some(self) -> None:
        for _ in range(_MAX_FRAMES_PER_ROUND):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            self._forgive_own_stall()
            if len(frames) != 2:
                self._drop(frames[0], f"{len(frames) - 1} payload frames instead of 1")
                continue
            identity, payload = frames
            try:
                message = CLIENT_TO_ENGINE.decode(payload)
            except Exception as exc:  # DecodeError, ValidationError, anything msgspec raises
                self._drop(identity, f"undecodable frame of {len(payload)} bytes: {exc}")
                self._salvage(identity, payload)
                continue
            self._handle(identity, message)

    def _handle(self, identity: bytes, message: object) -> None:
        registry = self.registry
        if isinstance(message, Hello):
            client = registry.attach(identity, message.client_name)
            logger.info("client %d attached (%s)", client.client_index, client.name or "unnamed")
            ready = Ready(
                client.client_index,
                self._config_msgpack,
                os.getpid(),
                self._engine_index,
                registry.heartbeat_timeout_s,
            )
            self._send(identity, ready)
            if self._latest_stats_frame is not None:
                self._router.send_multipart([identity, self._latest_stats_frame], copy=False)
        elif isinstance(message, Goodbye):
            client = registry.detach(identity)
            if client is not None:
                logger.info("client %d said goodbye", client.client_index)
                self._inputs.put(ClientGone(client.client_index, "goodbye"))
        else:
            client = registry.touch(identity)
            if client is None:
                self._reject_unattached(identity)
            elif isinstance(message, Heartbeat):
                self._router.send_multipart([identity, _HEARTBEAT_FRAME], copy=False)
            else:
                self._inputs.put(ClientInput(client.client_index, message))  # type: ignore[arg-type]

    def _reject_unattached(self, identity: bytes) -> None:
        # A client dropped for silence (its process was stalled, say) comes back still sending
        # heartbeats and requests: tell it its session is over, so that it neither waits for
        # outputs that never come nor goes on looking healthy.
        reason = (
            "this client is not attached to the engine: it was dropped after missing heartbeats "
            f"for over {self.registry.heartbeat_timeout_s:g} s (or never said Hello)"
        )
        self._send(identity, EngineDead(reason, client_dropped=True))

    def _salvage(self, identity: bytes, payload: bytes) -> None:
        """From a frame that did not decode, the requests that still can run, and an error
        output for each request whose id can be read but whose body cannot (a wrong type in a
        field): otherwise its client would wait for it forever, and one bad request in a batch
        would take the others with it."""
        try:
            fields = msgspec.msgpack.decode(payload)
        except Exception:  # not even msgpack: nothing names a request to answer
            return
        if not isinstance(fields, list) or len(fields) < 2:
            return
        if fields[0] == _REQUEST_TAG:
            items = [fields]
        elif fields[0] == _ADD_REQUESTS_TAG and isinstance(fields[1], list):
            items = fields[1]
        else:
            return
        if self.registry.touch(identity) is None:
            return  # not attached: it is told so when it sends anything readable
        good: list[EngineCoreRequest] = []
        failed: list[EngineCoreOutput] = []
        for item in items:
            try:
                good.append(_REQUEST_DECODER.decode(msgspec.msgpack.encode(item)))
            except Exception as exc:
                request_id = item[1] if isinstance(item, list) and len(item) > 1 else None
                if isinstance(request_id, str) and len(request_id) <= MAX_ANSWERED_ID_CHARS:
                    reason = f"the engine could not read the request: {exc}"
                    failed.append(EngineCoreOutput(request_id, [], "error", reason))
        if failed:
            self._send(identity, EngineOutputsFrame(EngineCoreOutputs(failed, time.monotonic())))
        if good:
            self._handle(identity, AddRequests(good))

    def _drop(self, identity: bytes, why: str) -> None:
        self.num_dropped_frames += 1
        # Bounded logging: a junk flood must not become a log flood.
        if self.num_dropped_frames <= 10 or self.num_dropped_frames % 1000 == 0:
            logger.warning(
                "dropped frame #%d from %s: %s", self.num_dropped_frames, identity.hex(), why
            )

    def _drop_silent_clients(self) -> None:
        # Stopped earlier in this round, the thread must not drop a client for a silence it
        # could not have heard.
        self._forgive_own_stall()
        for client in self.registry.detach_silent():
            logger.warning(
                "client %d silent for over %.1f s: aborting its requests",
                client.client_index,
                self.registry.heartbeat_timeout_s,
            )
            self._inputs.put(ClientGone(client.client_index, "heartbeat timeout"))

    def _send_queued(self) -> bool:
        """Send everything queued; False once the stop marker is reached."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_read, 4096):
                pass
        while True:
            try:
                item = self._outgoing.get_nowait()
            except queue.Empty:
                return True
            if item is _STOP:
                return False
            if isinstance(item, EngineDead):
                for identity in self.registry.identities():
                    self._send(identity, item)
                continue
            if isinstance(item, _StatsForAll):
                self._send_stats_to_all(item.stats)
                continue
            client_index, payload = item  # type: ignore[misc]
            identity = self.registry.identity_of(client_index)
            if identity is None:  # the client left: its outputs go nowhere
                continue
            if isinstance(payload, EngineCoreOutputs):
                payload = EngineOutputsFrame(payload)
            self._send(identity, payload)

    def _send_stats_to_all(self, stats: SchedulerStats) -> None:
        outputs = EngineCoreOutputs([], time.monotonic(), stats)
        frame = ENGINE_TO_CLIENT.encode(EngineOutputsFrame(outputs))  # encoded once for all
        self._latest_stats_frame = frame
        for identity in self.registry.identities():
            self._router.send_multipart([identity, frame], copy=False)

    def _send(self, identity: bytes, message: EngineCoreServerMessage) -> None:
        # A ROUTER never blocks on send: a peer over its high-water mark loses the frame instead.
        self._router.send_multipart([identity, ENGINE_TO_CLIENT.encode(message)], copy=False)
