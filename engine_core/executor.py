"""The executor interface: how the engine core gets a step run, wherever the workers live.

Runs in the engine-core process. Implementations: a fake for tests (``tests/fake_executor.py``),
the in-process worker (``worker.InProcessExecutor``) and, later, the multi-process executor. The
engine core never imports torch, so an implementation that needs it is handed in from outside.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from protocol import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    @abstractmethod
    def determine_num_blocks(self) -> int:
        """How many KV blocks every worker can hold (the minimum over workers)."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache; called once, before the first step."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and return the tokens rank 0 sampled."""

    def shutdown(self) -> None:  # noqa: B027 - most executors have nothing to release
        """Release processes and memory; safe to call more than once."""
