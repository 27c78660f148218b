"""``AsyncEngineClient``: the asyncio (uvloop-friendly) client an HTTP frontend streams through.

Runs in a frontend process, on its event loop. Every request gets its own queue and an async
iterator over its outputs; one task receives and dispatches the engine's frames, another sends
heartbeats and checks the engine process is alive. When the engine dies, every open stream raises
``EngineDeadError`` and so does every later ``add_request``; the same happens, with
``session_lost`` set, when the engine serves on but has dropped this client (it missed its
heartbeats: its process stalled). Everything runs on the loop's thread, so the one DEALER socket
is used by one thread only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Union

import msgspec
import zmq
import zmq.asyncio

from frontend.engine_process import EngineProcess
from frontend.engine_session import (
    DEFAULT_READY_TIMEOUT_S,
    HEARTBEAT_INTERVAL_S,
    LIVENESS_INTERVAL_S,
    EngineDeadError,
    EngineLiveness,
    EngineStartError,
    configure_dealer,
    decode_ready_config,
)
from protocol import Abort, EngineConfig, EngineCoreOutput, EngineCoreRequest, SchedulerStats
from protocol.codec import CLIENT_TO_ENGINE, ENGINE_TO_CLIENT
from protocol.messages import (
    AllFreeReport,
    CheckAllFree,
    EngineCoreClientMessage,
    EngineDead,
    EngineOutputsFrame,
    Goodbye,
    Heartbeat,
    Hello,
    Ready,
)

logger = logging.getLogger(__name__)

_StreamItem = Union[EngineCoreOutput, EngineDeadError]


class AsyncEngineClient:
    """Create with ``await AsyncEngineClient.start(config=...)`` or ``start(address=...)``."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        socket: zmq.asyncio.Socket,
        ready: Ready,
        liveness: EngineLiveness,
    ) -> None:
        self._context = context
        self._socket = socket
        self.client_index = ready.client_index
        self.engine_pid = ready.engine_pid
        self.config: EngineConfig = decode_ready_config(ready)
        self._liveness = liveness
        self._engine: EngineProcess | None = None
        self._streams: dict[str, asyncio.Queue[_StreamItem]] = {}
        self.dead_reason: str | None = None
        self._session_lost = False
        # The engine's latest scheduler stats, from the last outputs this client received.
        self.stats: SchedulerStats | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._reports: dict[int, asyncio.Future[AllFreeReport]] = {}
        self._next_query_id = 0

    @classmethod
    async def start(
        cls,
        config: EngineConfig | None = None,
        *,
        address: str | None = None,
        executor_backend: str | None = None,
        heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
        heartbeat_timeout_s: float | None = None,
        ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
        client_name: str = "",
    ) -> AsyncEngineClient:
        """Start an engine process from ``config`` (and own it), or attach at ``address``."""
        if (config is None) == (address is None):
            raise ValueError("give either a config (start an engine) or an address (attach)")
        engine = None
        if config is not None:
            # Spawned from the loop's own (long-lived) thread: the engine's parent-death signal
            # follows the thread that forked it.
            engine = EngineProcess(config, executor_backend, heartbeat_timeout_s).start()
            address = engine.address
        assert address is not None
        context = zmq.asyncio.Context()
        socket = context.socket(zmq.DEALER)
        configure_dealer(socket)
        try:
            socket.connect(address)
            liveness = engine.liveness() if engine else EngineLiveness(address)
            ready = await _handshake(socket, liveness, ready_timeout_s, client_name)
        except BaseException:
            socket.close(linger=0)
            context.term()
            if engine is not None:
                await asyncio.to_thread(engine.stop)
            raise
        if engine is None:
            liveness = EngineLiveness(address, ready.engine_pid)
        client = cls(context, socket, ready, liveness)
        client._engine = engine
        client._tasks = [
            asyncio.create_task(client._dispatch_outputs(), name="engine-outputs"),
            asyncio.create_task(client._keep_alive(heartbeat_interval_s), name="engine-heartbeat"),
        ]
        return client

    # ------------------------------------------------------------------ requests

    async def add_request(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        """Send a request; iterate the result for its outputs, the last one with finish_reason.

        Closing the iterator early (``aclose``, or a cancelled consumer) aborts the request.
        """
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if request.request_id in self._streams:
            raise ValueError(f"request_id {request.request_id!r} is already in flight")
        stream: asyncio.Queue[_StreamItem] = asyncio.Queue()
        self._streams[request.request_id] = stream
        try:
            await self._send(request)
        except BaseException:
            # Cancelled mid-send (its HTTP client left, say): the frame may be out already, and
            # nobody will ever iterate the stream whose cleanup would abort it.
            self._streams.pop(request.request_id, None)
            self.abort_nowait([request.request_id])
            raise
        return self._iterate(request.request_id, stream)

    @property
    def session_lost(self) -> bool:
        """The engine serves on but dropped this client: nothing more will be served through
        it, and only a new client (a new attach) is served again."""
        return self._session_lost

    async def abort(self, request_ids: list[str]) -> None:
        """Abort in the engine; each open stream then ends with finish_reason "abort"."""
        if request_ids and self.dead_reason is None:
            await self._send(Abort(list(request_ids)))

    def abort_nowait(self, request_ids: list[str]) -> None:
        """``abort`` without awaiting, for cleanup that must not await (a cancelled handler).

        Aborting a request that already finished does nothing.
        """
        if request_ids and self.dead_reason is None:
            self._post(Abort(list(request_ids)))

    async def ask_all_free(self, timeout_s: float = 5.0) -> str:
        """Ask the engine whether it is empty: "" if no request is left anywhere and every KV
        block is free with ref count 0, else what is left (or that debug queries are off)."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        self._next_query_id += 1
        query_id = self._next_query_id
        future: asyncio.Future[AllFreeReport] = asyncio.get_running_loop().create_future()
        self._reports[query_id] = future
        try:
            await self._send(CheckAllFree(query_id))
            return (await asyncio.wait_for(future, timeout_s)).problem
        finally:
            self._reports.pop(query_id, None)

    async def _iterate(
        self, request_id: str, stream: asyncio.Queue[_StreamItem]
    ) -> AsyncIterator[EngineCoreOutput]:
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, EngineDeadError):
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if not finished and self.dead_reason is None:
                # No await here: this may run while the generator is being closed by the loop.
                self._post(Abort([request_id]))

    # ------------------------------------------------------------------ shutdown

    async def shutdown(self, reason: str = "the client was shut down") -> None:
        """Say Goodbye, stop the tasks and, if we started it, the engine. Idempotent.

        Open streams raise ``EngineDeadError(reason)``; the engine aborts their requests.
        """
        if self._socket.closed:
            return
        if self.dead_reason is None:
            with contextlib.suppress(zmq.ZMQError):
                await self._send(Goodbye())
        self._fail_all(reason, expected=True)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._socket.close()
        # term() waits out the socket's linger (the Goodbye): off the loop's thread.
        await asyncio.to_thread(self._context.term)
        if self._engine is not None:
            await asyncio.to_thread(self._engine.stop)

    # ------------------------------------------------------------------ background tasks

    async def _dispatch_outputs(self) -> None:
        try:
            while self.dead_reason is None:
                frame = await self._socket.recv()
                try:
                    message = ENGINE_TO_CLIENT.decode(frame)
                except Exception as exc:
                    logger.warning("dropped an undecodable frame from the engine: %s", exc)
                    continue
                if isinstance(message, EngineOutputsFrame):
                    self._dispatch(message)
                elif isinstance(message, AllFreeReport):
                    future = self._reports.get(message.query_id)
                    if future is not None and not future.done():
                        future.set_result(message)
                elif isinstance(message, EngineDead):
                    self._fail_all(message.reason, session_lost=message.client_dropped)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must reach the streams, not leave them hanging
            logger.exception("engine output dispatch failed")
            self._fail_all(f"the client's output task failed: {exc!r}")

    def _dispatch(self, frame: EngineOutputsFrame) -> None:
        outputs = frame.outputs
        if outputs.scheduler_stats is not None:
            self.stats = outputs.scheduler_stats
        streams = self._streams
        for output in outputs.outputs:
            stream = streams.get(output.request_id)
            if stream is None:  # its consumer left, and the request was aborted
                continue
            stream.put_nowait(output)
            if output.finish_reason is not None:
                # Forget it now, not when the consumer gets there: a stream nobody iterates
                # must not keep its queue forever.
                del streams[output.request_id]

    async def _keep_alive(self, heartbeat_interval_s: float) -> None:
        heartbeat = Heartbeat()
        next_heartbeat = time.monotonic()
        while self.dead_reason is None:
            if time.monotonic() >= next_heartbeat:
                await self._send(heartbeat)
                next_heartbeat = time.monotonic() + heartbeat_interval_s
            reason = self._liveness.death_reason()
            if reason is not None:
                self._fail_all(reason)
                return
            await asyncio.sleep(LIVENESS_INTERVAL_S)

    def _fail_all(self, reason: str, expected: bool = False, session_lost: bool = False) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        self._session_lost = session_lost
        # Our own shutdown is no news to an operator; a dead engine or a lost session is.
        if expected:
            logger.info("engine session closed: %s", reason)
        elif session_lost:
            logger.error("engine session lost: %s", reason)
        else:
            logger.error("engine dead: %s", reason)
        error = EngineDeadError(reason)
        for stream in self._streams.values():
            stream.put_nowait(error)

    # ------------------------------------------------------------------ sending

    async def _send(self, message: EngineCoreClientMessage) -> None:
        await self._socket.send(CLIENT_TO_ENGINE.encode(message))

    def _post(self, message: EngineCoreClientMessage) -> None:
        """Send without awaiting; for code that may not await (a generator being closed)."""
        if self._socket.closed:
            return
        with contextlib.suppress(zmq.ZMQError):
            sent = self._socket.send(CLIENT_TO_ENGINE.encode(message))
            # Consume a late failure (socket closed meanwhile) so it is not reported as lost.
            sent.add_done_callback(lambda f: f.cancelled() or f.exception())


async def _handshake(
    socket: zmq.asyncio.Socket, liveness: EngineLiveness, timeout_s: float, client_name: str
) -> Ready:
    """Hello -> Ready, bounded and watching the engine process (the asyncio twin of
    ``engine_session.handshake``)."""
    await socket.send(CLIENT_TO_ENGINE.encode(Hello(client_name)))
    deadline = time.monotonic() + timeout_s
    while True:
        if await socket.poll(int(LIVENESS_INTERVAL_S * 1000), zmq.POLLIN):
            try:
                message = ENGINE_TO_CLIENT.decode(await socket.recv())
            except msgspec.DecodeError:
                continue  # not from a conveyor engine; keep waiting for one
            if isinstance(message, Ready):
                return message
            if isinstance(message, EngineDead):
                raise EngineStartError(f"the engine failed while starting: {message.reason}")
            continue
        reason = liveness.death_reason()
        if reason is not None:
            raise EngineStartError(f"{reason} before it was ready")
        if time.monotonic() > deadline:
            raise EngineStartError(f"the engine was not ready within {timeout_s:.0f} s")
