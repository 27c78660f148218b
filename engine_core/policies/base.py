"""The scheduling-policy interface: a policy decides who gets tokens this step, nothing more.

Runs in the engine-core process. The scheduler owns the machinery every policy shares (the token
budget, the width cap, block allocation, preemption, the diff to the workers); a policy only
chooses which of two moves to make, in which order: serve the running requests, admit waiting ones.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Protocol


class SchedulingStep(Protocol):
    """The moves a policy may make while one step is being scheduled."""

    @property
    def num_running(self) -> int:
        """Requests running now (including any admitted so far this step)."""
        ...

    @property
    def num_preemptions(self) -> int:
        """Requests preempted so far this step."""
        ...

    def schedule_running(self) -> None:
        """Give each running request, oldest first, what it needs while budget is left.

        A request needing more than the budget left (or the long-prefill threshold) gets a chunk.
        When blocks run out the scheduler preempts (the newest, or the lowest priority).
        """
        ...

    def admit_waiting(self, *, whole_prompts: bool, reserve_outputs: bool = False) -> int:
        """Admit waiting requests head first while width, budget and blocks allow.

        Stops at the first request that does not fit (head-of-line). ``whole_prompts``: a request
        is admitted only if everything it still needs fits in this step, else it gets a chunk.
        ``reserve_outputs``: blocks for all its future output tokens are taken now, so it can
        never be preempted. Returns the number of requests admitted.
        """
        ...


class SchedulingPolicy(ABC):
    """Chooses the moves of one step; selected by ``SchedulerConfig.policy``."""

    name: ClassVar[str]

    @abstractmethod
    def schedule(self, step: SchedulingStep) -> None:
        """Make this step's moves."""
