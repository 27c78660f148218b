"""``AsyncEngineClient``: the asyncio (uvloop-friendly) client an HTTP frontend streams through.

Runs in a frontend process: its state on the event loop, its socket on the client's socket thread
(``core_client.SocketThread``), which hands each message to the loop. Every request gets its own
queue and an async iterator over its outputs. When the engine dies, every open stream raises
``EngineDeadError`` and so does every later ``add_request``; the same happens, with
``session_lost`` set, when the engine serves on but has dropped this client.

The socket thread heartbeats while the loop answers: it asks the loop to note the time once per
heartbeat, and stays silent once the loop has not done so for ``LOOP_STALL_LIMIT_S``. So a busy
loop (or a long request) never gets this frontend dropped, and a stuck one does.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Union

import zmq

from conveyor.frontend.engine_client.core_client import (
    EngineClientBase,
    EngineMessage,
    launch_engine,
)
from conveyor.frontend.engine_client.engine_process import EngineProcess
from conveyor.frontend.engine_client.session import (
    DEFAULT_READY_TIMEOUT_S,
    HEARTBEAT_INTERVAL_S,
    EngineDeadError,
    connect,
)
from conveyor.protocol import (
    Abort,
    EngineConfig,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
)
from conveyor.protocol.messages import AllFreeReport, CheckAllFree, Goodbye, Ready

_StreamItem = Union[EngineCoreOutput, EngineDeadError]

# A loop that has not run a scheduled callback for this long is stuck, not busy: the work that
# grows with a request runs off the loop, and /health must answer within 100 ms.
LOOP_STALL_LIMIT_S = 10.0


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
        silence_limit_s: float | None = None,
    ) -> AsyncEngineClient:
        """Start an engine process from ``config`` (and own it), or attach at ``address``.

        ``heartbeat_timeout_s``: the started engine's patience with a silent client;
        ``silence_limit_s``: this client's with an engine that answers no heartbeat (None: five
        heartbeat intervals)."""
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
        return cls(
            address, ready, engine, client_name, context, dealer, heartbeat_interval_s,
            silence_limit_s,
        )  # fmt: skip

    def __init__(
        self,
        address: str,
        ready: Ready,
        engine: EngineProcess | None,
        client_name: str,
        context: zmq.Context,
        dealer: zmq.Socket,
        heartbeat_interval_s: float,
        silence_limit_s: float | None = None,
    ) -> None:
        """Use ``start``: it launches or attaches and does the handshake on ``dealer``."""
        super().__init__(address, ready, engine, client_name)
        self._loop = asyncio.get_running_loop()
        self._streams: dict[str, asyncio.Queue[_StreamItem]] = {}
        self._reports: dict[int, asyncio.Future[AllFreeReport]] = {}
        self._next_query_id = 0
        self._last_tick = time.monotonic()
        self._start_io(
            context,
            dealer,
            heartbeat_interval_s,
            lambda message: self._on_loop(self._handle_message, message),
            lambda reason: self._on_loop(self._mark_dead, reason),
            self._loop_responsive,
            silence_limit_s,
        )

    # ------------------------------------------------------------------ from the socket thread

    def _on_loop(self, callback: object, argument: object) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is left to tell
            self._loop.call_soon_threadsafe(callback, argument)  # type: ignore[arg-type]

    def _loop_responsive(self) -> bool:
        """Whether the loop ran the last tick we asked of it recently; asks for the next one."""
        responsive = time.monotonic() - self._last_tick < LOOP_STALL_LIMIT_S
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._tick)
        return responsive

    def _tick(self) -> None:
        self._last_tick = time.monotonic()

    # ------------------------------------------------------------------ EngineClientBase

    def _handle_message(self, message: EngineMessage) -> None:
        if self.dead_reason is None:  # late news for a client that is already closed
            super()._handle_message(message)

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
        if request.request_id in self._streams:
            raise ValueError(f"request_id {request.request_id!r} is already in flight")
        self._send(request)  # never blocks; EngineDeadError if the engine is gone
        stream: asyncio.Queue[_StreamItem] = asyncio.Queue()
        self._streams[request.request_id] = stream
        return self._iterate(request.request_id, stream)

    async def abort(self, request_ids: list[str]) -> None:
        """Abort in the engine; each open stream then ends with finish_reason "abort"."""
        self.abort_nowait(request_ids)

    def abort_nowait(self, request_ids: list[str]) -> None:
        """``abort`` without awaiting, for cleanup that must not await (a generator being
        closed). Aborting a request that already finished, or a dead engine's, does nothing."""
        if request_ids and self.dead_reason is None:
            with contextlib.suppress(EngineDeadError):
                self._send(Abort(list(request_ids)))

    async def ask_all_free(self, timeout_s: float = 5.0) -> str:
        """Ask the engine whether it is empty: "" if no request is left anywhere and every KV
        block is free with ref count 0, else what is left (or that debug queries are off)."""
        self._next_query_id += 1
        query_id = self._next_query_id
        future: asyncio.Future[AllFreeReport] = self._loop.create_future()
        self._reports[query_id] = future
        try:
            self._send(CheckAllFree(query_id))
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
            if not finished:
                self.abort_nowait([request_id])

    # ------------------------------------------------------------------ shutdown

    async def shutdown(self, reason: str = "the client was shut down") -> None:
        """Say Goodbye, stop the socket thread and, if we started it, the engine. Idempotent.

        Open streams raise ``EngineDeadError(reason)``; the engine aborts their requests.
        """
        if self.closing:
            return
        self.closing = True
        with contextlib.suppress(EngineDeadError):
            self._send(Goodbye())
        self._mark_dead(reason)
        # Joining the thread waits out the socket's linger (the Goodbye): off the loop.
        await asyncio.to_thread(self._stop_io)
        if self._engine is not None:
            await asyncio.to_thread(self._engine.stop)
