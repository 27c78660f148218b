"""The engine-core process: ``main(config, address)`` -> handshake -> busy loop -> clean exit.

Runs in the engine-core process (``python -m conveyor.entrypoints.engine``, which builds the executor and
calls ``main``). Three threads, one job each: the
socket thread (``ClientIO``) decodes client frames into a queue and sends output frames; the main
thread runs the busy loop (drain the queue, then schedule -> execute -> update) and blocks on the
queue when there is nothing to do, instead of spinning; a parent-watch thread stops us if the
process that started us dies. A fatal error becomes an ``EngineDead`` for every client and a
non-zero exit; SIGTERM/SIGINT become the same message (marked ``shutdown``) with exit 0.

Besides each step's outputs, which carry the scheduler's stats to the clients that have
outputs, the loop sends the stats to every client once a second while it works and once when it
goes idle: a frontend with no request in flight still exports the engine's current state.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable

import msgspec

from conveyor.engine_core.client_io import (
    BusyLoopInput,
    ClientGone,
    ClientInput,
    ClientIO,
    IOFailed,
)
from conveyor.engine_core.engine_core import EngineCore
from conveyor.engine_core.stats_logger import StatsLogger
from conveyor.executor.abstract import Executor
from conveyor.protocol import (
    Abort,
    EngineConfig,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
)
from conveyor.protocol.messages import AddRequests, AllFreeReport, CheckAllFree
from conveyor.runtime.exit_codes import ExitCode
from conveyor.runtime.gc_heap import freeze_startup_heap
from conveyor.runtime.parent import tie_to_parent
from conveyor.runtime.signals import (
    ShutdownRequested,
    ignore_shutdown_signals,
    install_shutdown_signals,
)
from conveyor.runtime.zmq_security import (
    CurveKeys,
    CurveKeysError,
    InsecureAddressError,
    check_address,
    faces_network,
    keys_from_env,
)

logger = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0
# Tests only: "raise@request=ID" makes handling the request named ID raise inside the engine.
ENGINE_FAULT_ENV = "CONVEYOR_ENGINE_FAULT_INJECT"
# How often an idle engine wakes up to ask the executor whether its workers are alive.
_IDLE_WAIT_S = 1.0
# How often a busy engine sends its stats to every client, not only to those with outputs.
STATS_BROADCAST_INTERVAL_S = 1.0


class EngineFatalError(RuntimeError):
    """The busy loop cannot go on (the socket thread died, a worker died while idle)."""


class EngineCoreProcess:
    """An ``EngineCore`` behind a ROUTER socket: serves any number of clients until stopped."""

    def __init__(
        self,
        core: EngineCore,
        address: str,
        heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
    ) -> None:
        self.core = core
        self._inputs: queue.Queue[BusyLoopInput] = queue.Queue()
        engine_index = core.config.parallel.data_parallel_rank
        self.io = ClientIO(
            address, ready_config_msgpack(core), self._inputs, heartbeat_timeout_s, engine_index
        )
        self.address = self.io.address
        observability = core.config.observability
        self.watchdog = StepWatchdog(observability.step_timeout_s, self._hung)
        self.stats_logger = StatsLogger(
            core.scheduler, observability.stats_interval_s, engine_index
        )
        self._next_stats_broadcast = 0.0
        self._is_faulty = _parse_engine_fault(os.environ.get(ENGINE_FAULT_ENV))

    def run(self) -> None:
        """The busy loop; returns after ``stop``, raises on a fatal error."""
        self.io.start()
        self.watchdog.start()
        self._broadcast_stats()  # so that a client attaching to an idle engine has them
        core, io, watchdog = self.core, self.io, self.watchdog
        while self._take_inputs(block=not core.has_unfinished_requests()):
            if core.has_unfinished_requests():
                watchdog.step_started()
                outputs = core.step()
                watchdog.step_ended()
                for client_index, client_outputs in outputs.items():
                    io.send_outputs(client_index, client_outputs)
                if not core.has_unfinished_requests() or (
                    time.monotonic() >= self._next_stats_broadcast
                ):
                    self._broadcast_stats()
                self.stats_logger.maybe_log()

    def _broadcast_stats(self) -> None:
        self.io.broadcast_stats(self.core.scheduler.make_stats())
        self._next_stats_broadcast = time.monotonic() + STATS_BROADCAST_INTERVAL_S

    def _hung(self, reason: str) -> None:
        """From the watchdog's thread: the busy loop is stuck, so it cannot clean up itself.

        Tell every client (bounded), then exit at once; the workers watch this process and
        stop when it is gone, and the supervisor sees a non-zero exit.
        """
        logger.error("%s; exiting", reason)
        self.io.broadcast_engine_dead(reason)
        self.io.stop()
        logging.shutdown()
        os._exit(ExitCode.HUNG)

    def stop(self) -> None:
        """Ask the busy loop to return after its current step (any thread)."""
        self._inputs.put(None)

    def close(self, reason: str, shutdown: bool = False) -> None:
        """Tell every client the engine is gone (``shutdown``: on purpose, not by a fault), then
        close the socket (bounded)."""
        self.io.broadcast_engine_dead(reason, shutdown)
        self.io.stop()

    def _take_inputs(self, block: bool) -> bool:
        """Apply every queued input (waiting for one if ``block``); False once stopped."""
        inputs = self._inputs
        while block:
            try:
                item = inputs.get(timeout=_IDLE_WAIT_S)
                break
            except queue.Empty:
                # A worker death is otherwise only noticed by the next step.
                self.core.executor.check_health()
                self.stats_logger.maybe_log()
        else:
            try:
                item = inputs.get_nowait()
            except queue.Empty:
                return True
        while True:
            if item is None:
                return False
            self._apply(item)
            try:
                item = inputs.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, item: ClientInput | ClientGone | IOFailed) -> None:
        core = self.core
        if isinstance(item, ClientInput):
            message = item.message
            if isinstance(message, EngineCoreRequest):
                self._add_request(message, item.client_index)
            elif isinstance(message, AddRequests):
                for request in message.requests:
                    self._add_request(request, item.client_index)
            elif isinstance(message, Abort):
                core.abort_requests(message.request_ids, item.client_index)
            elif isinstance(message, CheckAllFree):
                report = AllFreeReport(message.query_id, self._find_leftovers())
                self.io.send_report(item.client_index, report)
        elif isinstance(item, ClientGone):
            num_aborted = core.abort_client(item.client_index)
            if num_aborted:
                logger.info(
                    "client %d gone (%s): aborted %d requests",
                    item.client_index,
                    item.reason,
                    num_aborted,
                )
        elif isinstance(item, IOFailed):
            raise EngineFatalError(item.reason)

    def _add_request(self, request: EngineCoreRequest, client_index: int) -> None:
        """Queue a request; one that makes the engine raise fails alone, never the engine."""
        try:
            if self._is_faulty is not None and self._is_faulty(request):
                raise RuntimeError(f"injected fault ({ENGINE_FAULT_ENV})")
            rejected = self.core.add_request(request, client_index)
        except Exception as exc:
            logger.exception("request %r could not be added", request.request_id)
            self.core.abort_requests([request.request_id], client_index)
            output = EngineCoreOutput(request.request_id, [], "error", f"engine error: {exc!r}")
            rejected = EngineCoreOutputs([output], time.monotonic())
        if rejected is not None:
            self.io.send_outputs(client_index, rejected)

    def _find_leftovers(self) -> str:
        """Empty if no request is left and every KV block is free, else what is left."""
        if not self.core.config.observability.debug_queries:
            return "debug queries are disabled: start the engine with --enable-debug-queries"
        try:
            self.core.check_all_free()
        except AssertionError as exc:
            return str(exc) or "not all free"
        return ""


class StepWatchdog:
    """A thread that calls ``on_hang`` once if a step runs longer than ``timeout_s`` (0 = off).

    The busy loop marks each step's start and end (two attribute writes); the watchdog looks
    every ``timeout_s / 20`` (at most once a second), so a hang is noticed within ~5 % of the
    timeout.
    """

    def __init__(self, timeout_s: float, on_hang: Callable[[str], None]) -> None:
        self.timeout_s = timeout_s
        self._on_hang = on_hang
        self._started: float | None = None
        self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)

    def start(self) -> None:
        if self.timeout_s > 0:
            self._thread.start()

    def step_started(self) -> None:
        self._started = time.monotonic()

    def step_ended(self) -> None:
        self._started = None

    def _watch(self) -> None:
        interval = min(1.0, self.timeout_s / 20)
        while True:
            time.sleep(interval)
            started = self._started
            if started is not None and time.monotonic() - started > self.timeout_s:
                self._on_hang(f"a step has run for over {self.timeout_s:g} s: the engine is hung")
                return


def _parse_engine_fault(text: str | None) -> Callable[[EngineCoreRequest], bool] | None:
    """Which requests an injected fault hits: ``raise@request=ID`` (engine-level tests name the
    id) or ``raise@seed=N`` (the HTTP frontend makes its own ids, so tests over HTTP pick a
    request by its sampling seed)."""
    if not text:
        return None
    kind, _, value = text.removeprefix("raise@").partition("=")
    if text.startswith("raise@") and value:
        if kind == "request":
            return lambda request: request.request_id == value
        if kind == "seed" and value.isdigit():
            return lambda request: request.sampling_params.seed == int(value)
    raise ValueError(f"{ENGINE_FAULT_ENV}={text!r}: expected raise@request=ID or raise@seed=N")


def ready_config_msgpack(core: EngineCore) -> bytes:
    """The config clients receive in Ready: the engine's own, with what it learned from the
    workers (num_blocks, the sliding window) and max_model_len capped at the pool."""
    return msgspec.msgpack.encode(core.config)


def find_address_problem(
    address: str, allow_remote_clients: bool = False, keys: CurveKeys | None = None
) -> str | None:
    """Why the engine must not bind ``address``, or None: ipc:// or loopback tcp unless asked.

    Reaching the engine from another host must be a decision (``allow_remote_clients``), and
    never unauthenticated: it takes CURVE keys (``runtime.zmq_security``).
    """
    if address.startswith(("ipc://", "inproc://")):
        return None
    if not address.startswith("tcp://"):
        return f"address must be ipc://PATH or tcp://HOST:PORT, got {address!r}"
    if not faces_network(address):
        return None
    if not allow_remote_clients:
        return f"{address} is reachable from other hosts; bind 127.0.0.1 or allow remote clients"
    try:
        check_address(address, keys)
    except InsecureAddressError as exc:
        return str(exc)
    return None


def main(
    config: EngineConfig,
    address: str,
    make_executor: Callable[[EngineConfig], Executor],
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
    parent_pid: int | None = None,
    allow_remote_clients: bool = False,
) -> int:
    """Build, serve until a signal or a fatal error, clean up; returns the exit status.

    ``make_executor`` builds the workers (the engine core cannot: an in-process worker imports
    torch). With ``parent_pid``, the engine stops (as on SIGTERM) when that process dies.
    """
    try:
        problem = find_address_problem(address, allow_remote_clients, keys_from_env())
    except CurveKeysError as exc:
        problem = str(exc)
    if problem is not None:
        logger.error("%s", problem)
        return ExitCode.BAD_CONFIG
    install_shutdown_signals()
    executor: Executor | None = None
    core: EngineCore | None = None
    process: EngineCoreProcess | None = None
    reason, exit_code = "the engine was shut down", ExitCode.OK
    try:
        tie_to_parent(parent_pid)
        executor = make_executor(config)
        core = EngineCore(config, executor)
        process = EngineCoreProcess(core, address, heartbeat_timeout_s)
        freeze_startup_heap()
        logger.info(
            "engine core ready on %s (%d KV blocks of %d tokens, cache dtype %s, executor %s)",
            process.address,
            core.scheduler.kv_cache_manager.block_pool.num_blocks,
            config.cache.block_size,
            config.cache.cache_dtype,
            type(executor).__name__,
        )
        process.run()
    except ShutdownRequested as signal_name:
        logger.info("shutting down on %s", signal_name)
    except Exception as exc:
        logger.exception("engine core failed")
        reason, exit_code = f"engine core failed: {exc!r}", ExitCode.FAILED
    finally:
        ignore_shutdown_signals()  # the cleanup is bounded; a second Ctrl-C must not cut it short
        if process is not None:
            process.close(reason, shutdown=exit_code == ExitCode.OK)
        if core is not None:
            core.shutdown()  # also closes the step trace
        elif executor is not None:
            executor.shutdown()
    return exit_code
