"""The multi-process executor: one worker process per tensor-parallel rank.

Runs in the engine-core process, and never imports torch. Each step's ``SchedulerOutput`` (the
diff) is encoded once and the same bytes go to every rank; rank 0 alone sends back the sampled
tokens. No wait is unbounded: every wait polls the reply socket in short slices and checks each
worker's exit status in between, so a dead worker becomes ``WorkerDiedError`` within about
``POLL_INTERVAL_S`` instead of a hang, and an exception inside a worker arrives as
``WorkerFailedError`` with the worker's reason. After either, the executor is broken for good
(every later call raises the same error); the engine treats it as fatal and calls ``shutdown``.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import deque
from typing import NoReturn, TypeVar

import msgspec

from conveyor.executor.abstract import Executor
from conveyor.executor.worker_processes import SHUTDOWN_GRACE_S, WorkerProcesses, WorkersClosedError
from conveyor.protocol import EngineConfig, ModelRunnerOutput, SchedulerOutput
from conveyor.protocol.worker_messages import (
    WORKER_COMMAND,
    WORKER_REPLY,
    CacheReady,
    DetermineNumBlocks,
    ExecuteModel,
    InitializeCache,
    NumBlocks,
    StepOutput,
    WorkerCommand,
    WorkerError,
    WorkerReady,
    WorkerReply,
)
from conveyor.runtime.processes import describe_exit

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1
# Loading a large model (or profiling memory on a GPU) can take minutes.
DEFAULT_STARTUP_TIMEOUT_S = 600.0
# After a fault, how long to gather the other ranks' errors and exits before naming the cause.
_LAST_WORDS_S = 0.3

ReplyT = TypeVar("ReplyT", WorkerReady, NumBlocks, CacheReady)


class ExecutorError(RuntimeError):
    """The workers cannot run steps any more; the engine must stop."""


class WorkerDiedError(ExecutorError):
    def __init__(self, rank: int, pid: int, returncode: int) -> None:
        super().__init__(f"worker rank {rank} (pid {pid}) {describe_exit(returncode)}")
        self.rank = rank
        self.returncode = returncode


class WorkerFailedError(ExecutorError):
    """A worker raised; ``reason`` is its exception, as it reported it."""

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(f"worker rank {rank} failed: {reason}")
        self.rank = rank
        self.reason = reason


class WorkerTimeoutError(ExecutorError):
    pass


class RemoteNodeError(ExecutorError):
    """A host running some of the ranks failed, never joined, or went silent."""


class MultiprocExecutor(Executor):
    """Starts ``tensor_parallel_size`` worker processes and waits until each has its model."""

    def __init__(
        self,
        config: EngineConfig,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        step_timeout_s: float | None = None,
        workers: WorkerProcesses | None = None,
    ) -> None:
        """``workers``: where the ranks run, if not in processes started here (Ray actors)."""
        self.config = config
        self.startup_timeout_s = startup_timeout_s
        # None: a step may take as long as it takes (a long CPU prefill), death is still noticed.
        self.step_timeout_s = step_timeout_s
        self._failure: ExecutorError | None = None
        self._pending_step_ids: deque[int] = deque()
        self._sliding_window: int | None = None  # learned in determine_num_blocks
        parallel = config.parallel
        self._workers = workers or WorkerProcesses(parallel.tensor_parallel_size, parallel.nodes)
        # Stops the workers if the executor is dropped or the interpreter exits without shutdown.
        self._finalizer = weakref.finalize(self, self._workers.close)
        try:
            self._workers.start(config)
            ready = self._collect(WorkerReady, startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d worker(s) ready: pids %s", len(ready), [r.pid for r in ready])

    # ------------------------------------------------------------------ Executor

    def determine_num_blocks(self) -> int:
        self._broadcast(DetermineNumBlocks())
        replies = self._collect(NumBlocks, self.startup_timeout_s)
        # Every rank holds the same layers, so the same window.
        self._sliding_window = replies[0].sliding_window
        return min(reply.num_blocks for reply in replies)

    def kv_sliding_window(self) -> int | None:
        return self._sliding_window

    def initialize_cache(self, num_blocks: int) -> None:
        self._broadcast(InitializeCache(num_blocks))
        self._collect(CacheReady, self.startup_timeout_s)

    def shutdown(self) -> None:
        # Broken workers get no grace: they are dead, hung, or stuck in a collective.
        self._workers.close(grace_s=SHUTDOWN_GRACE_S if self._failure is None else 0.0)
        self._finalizer.detach()

    # ------------------------------------------------------------------ split steps

    def submit_step(self, scheduler_output: SchedulerOutput) -> None:
        """Send a step to every rank without waiting for it (steps queue up in order)."""
        self._broadcast(ExecuteModel(scheduler_output))
        self._pending_step_ids.append(scheduler_output.step_id)

    def wait_for_output(self) -> ModelRunnerOutput:
        """Rank 0's output for the oldest submitted step."""
        if not self._pending_step_ids:
            raise RuntimeError("wait_for_output without a submitted step")
        step_id = self._pending_step_ids.popleft()
        deadline = None if self.step_timeout_s is None else time.monotonic() + self.step_timeout_s
        while True:
            reply = self._receive(deadline)
            if isinstance(reply, StepOutput) and reply.output.step_id == step_id:
                return reply.output
            logger.warning(
                "dropped an unexpected reply while waiting for step %d: %r", step_id, reply
            )

    def check_health(self) -> None:
        """Raise what step would raise if a worker is gone; cheap, for an idle engine to call."""
        self._raise_if_failed()
        self._raise_if_dead()

    # ------------------------------------------------------------------ introspection

    @property
    def worker_pids(self) -> list[int]:
        return self._workers.pids()

    @property
    def reply_address(self) -> str:
        return self._workers.reply_address

    # ------------------------------------------------------------------ plumbing

    def _broadcast(self, command: WorkerCommand) -> None:
        self._raise_if_failed()
        frame = WORKER_COMMAND.encode(command)
        for rank in range(self._workers.num_workers):
            while not self._send(rank, frame):
                # A full queue: the rank fell far behind, or it is gone. Only the latter is an error.
                self._raise_if_dead()

    def _send(self, rank: int, frame: bytes) -> bool:
        try:
            return self._workers.send(rank, frame)
        except WorkersClosedError as exc:
            raise ExecutorError("the executor was shut down") from exc

    def _collect(self, reply_type: type[ReplyT], timeout_s: float) -> list[ReplyT]:
        """One ``reply_type`` from every rank, in rank order."""
        deadline = time.monotonic() + timeout_s
        replies: dict[int, ReplyT] = {}
        while len(replies) < self._workers.num_workers:
            reply = self._receive(deadline)
            if isinstance(reply, reply_type):
                replies[reply.rank] = reply
            else:
                logger.warning("dropped an unexpected %s reply", type(reply).__name__)
        return [replies[rank] for rank in sorted(replies)]

    def _receive(self, deadline: float | None) -> WorkerReply:
        """The next well-formed reply; raises on a worker's error or death, or at the deadline."""
        self._raise_if_failed()
        while True:
            frame = self._receive_frame(int(POLL_INTERVAL_S * 1000))
            reply = None if frame is None else self._decode(frame)
            if isinstance(reply, WorkerError):
                self._fail_with_root_cause({reply.rank: reply})
            if reply is not None:
                return reply
            self._raise_if_dead()
            if deadline is not None and time.monotonic() > deadline:
                self._fail(WorkerTimeoutError("the workers did not answer in time"))

    def _receive_frame(self, timeout_ms: int) -> bytes | None:
        try:
            return self._workers.receive(timeout_ms)
        except WorkersClosedError as exc:
            raise ExecutorError("the executor was shut down") from exc

    def _decode(self, frame: bytes) -> WorkerReply | None:
        try:
            return WORKER_REPLY.decode(frame)
        except msgspec.DecodeError as exc:
            # Junk is dropped, never fatal.
            logger.warning("dropped a malformed %d-byte reply frame: %s", len(frame), exc)
            return None

    def _raise_if_dead(self) -> None:
        if self._workers.exited():
            self._fail_with_root_cause({})
        problem = self._workers.remote_problem()
        if problem is not None:
            self._fail(RemoteNodeError(problem))

    def _fail_with_root_cause(self, errors: dict[int, WorkerError]) -> NoReturn:
        """Something went wrong: gather what else did in a short window, then blame the cause.

        One fault cascades in tensor parallelism: a rank that raises reports and exits, and its
        peers then fail inside a collective and report too. A rank that died without a word
        (killed, crashed) is the cause; otherwise the earliest error is.
        """
        deadline = time.monotonic() + _LAST_WORDS_S
        while (remaining_s := deadline - time.monotonic()) > 0:
            frame = self._receive_frame(max(1, int(remaining_s * 1000)))
            reply = None if frame is None else self._decode(frame)
            if isinstance(reply, WorkerError):
                errors.setdefault(reply.rank, reply)
        for rank, returncode in self._workers.exited():
            if rank not in errors:
                self._fail(WorkerDiedError(rank, self._workers.pid_of(rank), returncode))
        first = min(errors.values(), key=lambda error: error.monotonic_time)
        self._fail(WorkerFailedError(first.rank, first.reason))

    def _fail(self, error: ExecutorError) -> NoReturn:
        if self._failure is None:
            logger.error("%s", error)
            self._failure = error
        raise self._failure

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._workers.closing:
            raise ExecutorError("the executor was shut down")
