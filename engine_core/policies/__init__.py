"""Scheduling policies, one per file, selected by name (``SchedulerConfig.policy``).

Runs in the engine-core process.
"""

from __future__ import annotations

from conveyor.engine_core.policies.base import SchedulingPolicy, SchedulingStep
from conveyor.engine_core.policies.orca import OrcaPolicy
from conveyor.engine_core.policies.prefill_first import PrefillFirstPolicy
from conveyor.engine_core.policies.stall_free import StallFreePolicy
from conveyor.engine_core.policies.static import StaticPolicy

POLICY_CLASSES: dict[str, type[SchedulingPolicy]] = {
    cls.name: cls for cls in (StallFreePolicy, PrefillFirstPolicy, OrcaPolicy, StaticPolicy)
}


def make_policy(name: str) -> SchedulingPolicy:
    try:
        return POLICY_CLASSES[name]()
    except KeyError:
        raise ValueError(
            f"policy must be one of {', '.join(POLICY_CLASSES)}, got {name!r}"
        ) from None


__all__ = [
    "POLICY_CLASSES",
    "OrcaPolicy",
    "PrefillFirstPolicy",
    "SchedulingPolicy",
    "SchedulingStep",
    "StallFreePolicy",
    "StaticPolicy",
    "make_policy",
]
