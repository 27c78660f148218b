"""The in-process executor: one worker running inside the engine-core process.

Runs in the engine-core process. It has the four methods of ``engine_core.executor.Executor``
(``determine_num_blocks``, ``initialize_cache``, ``execute_model``, ``shutdown``) but does not
subclass it: the worker package may not import the engine core. Whoever builds both registers it
as an ``Executor`` (``Executor.register(InProcessExecutor)``).
"""

from __future__ import annotations

from protocol import EngineConfig, ModelRunnerOutput, SchedulerOutput
from worker.worker import Worker


class InProcessExecutor:
    """Tensor parallelism needs several processes, so this executor runs exactly one rank."""

    def __init__(self, config: EngineConfig) -> None:
        if config.parallel.tensor_parallel_size != 1:
            raise ValueError("the in-process executor runs one worker: tensor_parallel_size=1")
        self.worker: Worker | None = Worker(config, rank=0)

    def _live_worker(self) -> Worker:
        if self.worker is None:
            raise RuntimeError("the executor was shut down")
        return self.worker

    def determine_num_blocks(self) -> int:
        return self._live_worker().determine_num_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self._live_worker().initialize_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._live_worker().execute_model(scheduler_output)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
