"""``AsyncEngineClient``: the asyncio (uvloop-friendly) client an HTTP frontend streams through.

Runs in a frontend process, on its event loop. Every request gets its own queue and an async
iterator over its outputs; one task receives and dispatches the engine's frames, another sends
heartbeats and checks the engine process is alive. When the engine dies, every open stream raises
``EngineDeadError`` and so does every later ``add_request``; the same happens, with
``session_lost`` set, when the engine serves on but has dropped this client (it missed its
heartbeats: its process stalled). Everything runs on the loop's thread, so the one DEALER socket
is used by one thread only (the handshake, in a worker thread, finishes before the loop uses it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Union

import zmq
import zmq.asyncio

from frontend.engine_client.core_client import EngineClientBase, launch_engine
from frontend.engine_client.engine_process import EngineProcess
from frontend.engine_client.session import (
    DEFAULT_READY_TIMEOUT_S,
    HEARTBEAT_FRAME,
    HEARTBEAT_INTERVAL_S,
    LIVENESS_INTERVAL_S,
    EngineDeadError,
    connect,
)
from protocol import Abort, EngineConfig, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from protocol.codec import CLIENT_TO_ENGINE
from protocol.messages import (
    AllFreeReport,
    CheckAllFree,
    EngineCoreClientMessage,
    Goodbye,
    Ready,
)

logger = logging.getLogger(__name__)

_StreamItem = Union[EngineCoreOutput, EngineDeadError]


class AsyncEngineClient(EngineClientBase):
    """Create with ``await AsyncEngineClient.start(config=...)`` or ``start(address=...)``."""

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
        # Spawned from the loop's own (long-lived) thread: the engine's parent-death signal
        # follows the thread that forked it.
        engine, address, liveness = launch_engine(
            config, address, executor_backend, heartbeat_timeout_s
        )
        context = zmq.Context()
        try:
            # The handshake blocks (an engine may take minutes to load): off the loop.
            dealer, ready = await asyncio.to_thread(
                connect, context, address, liveness, ready_timeout_s, client_name
            )
        except BaseException:
            context.term()
            if engine is not None:
                await asyncio.to_thread(engine.stop)
            raise
        client = cls(address, ready, engine, client_name, context, dealer)
        client._tasks = [
            asyncio.create_task(client._receive_frames(), name="engine-outputs"),
            asyncio.create_task(client._keep_alive(heartbeat_interval_s), name="engine-heartbeat"),
        ]
        return client

    def __init__(
        self,
        address: str,
        ready: Ready,
        engine: EngineProcess | None,
        client_name: str,
        context: zmq.Context,
        dealer: zmq.Socket,
    ) -> None:
        """Use ``start``: it launches or attaches and does the handshake on ``dealer``, which
        the event loop drives from here on."""
        super().__init__(address, ready, engine, client_name)
        self._context = context
        self._socket = zmq.asyncio.Socket.from_socket(dealer)
        self._streams: dict[str, asyncio.Queue[_StreamItem]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._reports: dict[int, asyncio.Future[AllFreeReport]] = {}
        self._next_query_id = 0

    # ------------------------------------------------------------------ EngineClientBase

    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
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

    def _on_report(self, report: AllFreeReport) -> None:
        future = self._reports.get(report.query_id)
        if future is not None and not future.done():
            future.set_result(report)

    def _on_dead(self, error: EngineDeadError) -> None:
        for stream in self._streams.values():
            stream.put_nowait(error)

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
        self.closing = True
        if self.dead_reason is None:
            with contextlib.suppress(zmq.ZMQError):
                await self._send(Goodbye())
        self._mark_dead(reason)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._socket.close()
        # term() waits out the socket's linger (the Goodbye): off the loop's thread.
        await asyncio.to_thread(self._context.term)
        if self._engine is not None:
            await asyncio.to_thread(self._engine.stop)

    # ------------------------------------------------------------------ background tasks

    async def _receive_frames(self) -> None:
        try:
            while self.dead_reason is None:
                if not self._handle_frame(await self._socket.recv()):
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must reach the streams, not leave them hanging
            logger.exception("engine output dispatch failed")
            self._mark_dead(f"the client's output task failed: {exc!r}")

    async def _keep_alive(self, heartbeat_interval_s: float) -> None:
        next_heartbeat = time.monotonic()
        while self.dead_reason is None:
            if time.monotonic() >= next_heartbeat:
                await self._socket.send(HEARTBEAT_FRAME)
                next_heartbeat = time.monotonic() + heartbeat_interval_s
            if not self._check_liveness():
                return
            await asyncio.sleep(LIVENESS_INTERVAL_S)

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
