"""One worker inside this process: ``--executor-backend inprocess`` and ``LLM(engine="inprocess")``.

Runs in the engine-core process, or in the caller's for ``LLM(engine="inprocess")``. The engine
core never imports torch, so the worker is built by whoever chose this backend (``make_executor``,
the in-process client) and handed in.
"""

from __future__ import annotations

from typing import Protocol

from conveyor.executor.abstract import InlineExecutor
from conveyor.protocol import ModelRunnerOutput, SchedulerOutput


class LocalWorker(Protocol):
    """What ``InProcessExecutor`` needs of a worker (``worker.Worker`` has it)."""

    def determine_num_blocks(self) -> int: ...

    def initialize_cache(self, num_blocks: int) -> None: ...

    def kv_sliding_window(self) -> int | None: ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...


class InProcessExecutor(InlineExecutor):
    """One worker inside this process: tensor parallelism needs several, so TP=1 only."""

    def __init__(self, worker: LocalWorker) -> None:
        super().__init__()
        self._worker: LocalWorker | None = worker

    def _live_worker(self) -> LocalWorker:
        if self._worker is None:
            raise RuntimeError("the executor was shut down")
        return self._worker

    def determine_num_blocks(self) -> int:
        return self._live_worker().determine_num_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self._live_worker().initialize_cache(num_blocks)

    def kv_sliding_window(self) -> int | None:
        return self._live_worker().kv_sliding_window()

    def run_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._live_worker().execute_model(scheduler_output)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None
