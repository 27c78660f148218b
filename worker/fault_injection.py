"""Faults on purpose, for reliability tests: ``CONVEYOR_FAULT_INJECT`` in a worker's environment.

Runs in worker processes. The value is ``ACTION@WHEN[,rank=R]``:

- ACTION: ``raise`` (an exception inside the worker, reported as ``WorkerError``), ``exit`` (the
  process exits with status 17 without a word, like a crash), or ``hang`` (never returns).
- WHEN: ``load`` (while the model loads) or ``step=N`` (the first step whose step_id >= N; steps
  with nothing scheduled never reach the workers, so an exact id might never come).
- ``rank=R`` limits the fault to one rank; by default every rank fails.

Examples: ``raise@step=3``, ``exit@step=2,rank=1``, ``hang@load``. Unset or empty: no fault.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

FAULT_ENV = "CONVEYOR_FAULT_INJECT"
FAULT_EXIT_CODE = 17
ACTIONS = ("raise", "exit", "hang")


class InjectedFault(RuntimeError):
    """The exception a ``raise`` fault throws."""


@dataclass(frozen=True)
class FaultPlan:
    action: str
    # None = while loading; otherwise the first step with step_id >= this.
    step_id: int | None
    rank: int | None = None


def parse_fault_plan(text: str | None) -> FaultPlan | None:
    """``"raise@step=3,rank=1"`` -> FaultPlan; ValueError naming the problem for a bad value."""
    if not text:
        return None
    action, sep, rest = text.partition("@")
    if action not in ACTIONS or not sep:
        raise ValueError(f"{FAULT_ENV}={text!r}: expected ACTION@WHEN with ACTION in {ACTIONS}")
    when, *options = rest.split(",")
    step_id: int | None = None
    if when.startswith("step="):
        step_id = int(when.removeprefix("step="))
    elif when != "load":
        raise ValueError(f"{FAULT_ENV}={text!r}: WHEN must be 'load' or 'step=N'")
    rank = None
    for option in options:
        if not option.startswith("rank="):
            raise ValueError(f"{FAULT_ENV}={text!r}: unknown option {option!r}")
        rank = int(option.removeprefix("rank="))
    return FaultPlan(action, step_id, rank)


def fault_plan_from_env() -> FaultPlan | None:
    return parse_fault_plan(os.environ.get(FAULT_ENV))


class FaultInjector:
    """Fires its plan at most once, on the matching rank, at load or at the matching step."""

    def __init__(self, plan: FaultPlan | None, rank: int) -> None:
        self._plan = plan if plan is not None and plan.rank in (None, rank) else None

    def at_load(self) -> None:
        if self._plan is not None and self._plan.step_id is None:
            self._fire()

    def at_step(self, step_id: int) -> None:
        plan = self._plan
        if plan is not None and plan.step_id is not None and step_id >= plan.step_id:
            self._fire()

    def _fire(self) -> None:
        assert self._plan is not None
        action, self._plan = self._plan.action, None
        if action == "raise":
            raise InjectedFault(f"injected fault ({FAULT_ENV})")
        if action == "exit":
            os._exit(FAULT_EXIT_CODE)
        while True:  # hang
            time.sleep(3600)
