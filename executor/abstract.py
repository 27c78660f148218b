"""The executor interface: how the engine core gets a step run, wherever the workers live.

Runs in the engine-core process (or, for ``LLM(engine="inprocess")``, in the caller's). A step is
split in two, ``submit_step`` then ``wait_for_output``, so that with async scheduling the engine
schedules step N+1 while step N runs; ``execute_model`` is the two back to back. Implementations:
``MultiprocExecutor`` (worker processes, ``multiproc``; their ranks may be Ray actors,
``ray_workers``), ``InProcessExecutor`` (one worker in this process, ``inprocess``) and the fake of
the tests.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque

from conveyor.protocol import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    @abstractmethod
    def determine_num_blocks(self) -> int:
        """How many KV blocks every worker can hold (the minimum over workers)."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache; called once, before the first step."""

    def kv_sliding_window(self) -> int | None:
        """How far back the model attends, learned with the block count: a request's blocks
        wholly behind it are freed while the request runs. None: the whole context."""
        return None

    @abstractmethod
    def submit_step(self, scheduler_output: SchedulerOutput) -> None:
        """Start a step without waiting for it; steps run, and their outputs return, in order."""

    @abstractmethod
    def wait_for_output(self) -> ModelRunnerOutput:
        """The tokens rank 0 sampled in the oldest submitted step."""

    @abstractmethod
    def check_health(self) -> None:
        """Raise what the next step would raise if a worker is gone; cheap, called while idle."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release processes and memory; safe to call more than once."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and return the tokens rank 0 sampled."""
        self.submit_step(scheduler_output)
        return self.wait_for_output()


class InlineExecutor(Executor):
    """An executor that runs a step inside ``submit_step``: there is no worker to wait for.

    Async scheduling then gives the same tokens as synchronous scheduling without the overlap.
    """

    def __init__(self) -> None:
        self._outputs: deque[ModelRunnerOutput] = deque()

    @abstractmethod
    def run_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step now."""

    def submit_step(self, scheduler_output: SchedulerOutput) -> None:
        self._outputs.append(self.run_step(scheduler_output))

    def wait_for_output(self) -> ModelRunnerOutput:
        if not self._outputs:
            raise RuntimeError("wait_for_output without a submitted step")
        return self._outputs.popleft()

    def check_health(self) -> None:
        """Nothing to lose: a step that fails raises in the caller's own thread."""
