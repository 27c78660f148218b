"""``MPEngineClient``: the blocking client ``LLM`` uses to drive an engine-core process over ZMQ.

Runs in the frontend process. The same calls as ``InProcessEngineClient`` (add_requests, abort,
step, has_unfinished_requests, check_all_free, shutdown), so ``LLM`` does not care where the
engine lives. Given a config it starts its own engine process; given an address it attaches to
a running one (beside any number of other clients).

The client's socket thread (``core_client.SocketThread``) queues the engine's outputs for the
caller. Every caller wait is bounded by its liveness check: a dead engine surfaces as
``EngineDeadError`` within about a second, never a hang.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import time
import weakref
from typing import Union

import zmq

from conveyor.frontend.engine_client.core_client import EngineClientBase, launch_engine
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
from conveyor.protocol.messages import AddRequests, AllFreeReport, CheckAllFree, Goodbye

_query_ids = itertools.count()
# How long step() waits for outputs before handing control back to the caller's loop.
STEP_TIMEOUT_S = 1.0
# How long check_all_free waits for the final outputs of aborted requests.
CHECK_TIMEOUT_S = 5.0

_QueueItem = Union[EngineCoreOutputs, EngineDeadError]


class MPEngineClient(EngineClientBase):
    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        address: str | None = None,
        executor_backend: str | None = None,
        heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
        heartbeat_timeout_s: float | None = None,
        ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
        client_name: str = "",
    ) -> None:
        """``config``: start an engine process and own it; ``address``: attach to a running one.

        ``heartbeat_timeout_s`` is the started engine's patience with silent clients.
        """
        engine, address, liveness = launch_engine(
            config, address, executor_backend, heartbeat_timeout_s
        )
        if engine is not None:
            # Even a client never shut down must not leave its engine running past our exit.
            self._finalizer = weakref.finalize(self, engine.stop)
        context = zmq.Context()
        try:
            dealer, ready = connect(context, address, liveness, ready_timeout_s, client_name)
        except BaseException:
            context.term()
            if engine is not None:
                engine.stop()
            raise
        super().__init__(address, ready, engine, client_name)
        self.outputs: queue.SimpleQueue[_QueueItem] = queue.SimpleQueue()
        self._reports: queue.SimpleQueue[AllFreeReport] = queue.SimpleQueue()
        # The socket thread acts on each message itself: the caller reads the queues.
        self._start_io(context, dealer, heartbeat_interval_s, self._handle_message, self._mark_dead)
        self._unfinished: set[str] = set()
        # Unfinished requests we aborted: their final outputs are on the way.
        self._aborted: set[str] = set()

    # ------------------------------------------------------------------ EngineClientBase

    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        self.outputs.put(outputs)

    def _on_report(self, report: AllFreeReport) -> None:
        self._reports.put(report)

    def _on_dead(self, error: EngineDeadError) -> None:
        self.outputs.put(error)

    # ------------------------------------------------------------------ requests

    def add_request(self, request: EngineCoreRequest) -> list[EngineCoreOutput]:
        """Send a request; a rejection comes back later as an output with finish_reason "error"."""
        return self.add_requests([request])

    def add_requests(self, requests: list[EngineCoreRequest]) -> list[EngineCoreOutput]:
        """Send several requests in one message: the engine adds them all before its next step."""
        if requests:
            self._send(AddRequests(list(requests)))
            self._unfinished.update(r.request_id for r in requests)
        return []

    def abort(self, request_ids: list[str]) -> None:
        """Abort in the engine; each request still ends with one final output. A no-op once dead."""
        if request_ids and self.dead_reason is None:
            self._send(Abort(list(request_ids)))
            self._aborted.update(r for r in request_ids if r in self._unfinished)

    def get_outputs(self, timeout_s: float | None = None) -> EngineCoreOutputs | None:
        """The next outputs for this client, or None after ``timeout_s``; EngineDeadError if dead."""
        try:
            item = self.outputs.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if isinstance(item, EngineDeadError):
            self.outputs.put(item)  # every later call fails the same way
            self._unfinished.clear()  # the engine and every request in it are gone
            self._aborted.clear()
            raise item
        for output in item.outputs:
            if output.finish_reason is not None:
                self._unfinished.discard(output.request_id)
                self._aborted.discard(output.request_id)
        return item

    def step(self) -> EngineCoreOutputs | None:
        """The engine steps on its own: wait (bounded) for the next outputs it sent us."""
        return self.get_outputs(STEP_TIMEOUT_S)

    def has_unfinished_requests(self) -> bool:
        """True while a request of ours has not sent its final output."""
        return bool(self._unfinished)

    def check_all_free(self, timeout_s: float = CHECK_TIMEOUT_S) -> None:
        """AssertionError unless none of our requests is left and the engine itself is empty.

        Waits (bounded) for the final outputs of requests we aborted (the abort is on its way),
        then asks the engine (``CheckAllFree``, answered by engines started with debug queries):
        no request in any queue, every KV block free with ref count 0. Asks again until the
        answer is "free" or ``timeout_s`` passes, as an engine may still be finishing a step.
        """
        deadline = time.monotonic() + timeout_s
        while self._unfinished == self._aborted and self._aborted:
            if time.monotonic() > deadline:
                break
            self.get_outputs(0.1)
        if self._unfinished:
            raise AssertionError(f"{len(self._unfinished)} requests still unfinished")
        while True:
            problem = self.ask_all_free(max(0.1, deadline - time.monotonic()))
            if not problem or time.monotonic() > deadline or "disabled" in problem:
                break
            time.sleep(0.05)
        if problem:
            raise AssertionError(f"the engine is not empty: {problem}")

    def ask_all_free(self, timeout_s: float = CHECK_TIMEOUT_S) -> str:
        """One ``CheckAllFree`` round trip: "" if the engine is empty, else what is left."""
        query_id = next(_query_ids)
        self._send(CheckAllFree(query_id))
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                report = self._reports.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError("the engine did not answer CheckAllFree in time") from None
            if report.query_id == query_id:
                return report.problem

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        """Say Goodbye, stop the socket thread and, if we started it, the engine. Idempotent."""
        if self.closing:
            return
        self.closing = True
        with contextlib.suppress(EngineDeadError):
            self._send(Goodbye())
        self._stop_io()
        self._mark_dead("the client was shut down")
        if self._engine is not None:
            self._finalizer()

    def __enter__(self) -> MPEngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
