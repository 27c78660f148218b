"""Orca-style iteration-level batching: requests join and leave every step, prompts whole.

Runs in the engine-core process. Admission reserves blocks for the prompt and every output token
the request may produce (``max_tokens``), so a running request never runs out of blocks and
nothing is ever preempted; the price is memory held for outputs that may never come. The queue
is strictly head-of-line: if the head does not fit, nobody behind it is admitted.
"""

from __future__ import annotations

from conveyor.engine_core.policies.base import SchedulingPolicy, SchedulingStep


class OrcaPolicy(SchedulingPolicy):
    name = "orca"

    def schedule(self, step: SchedulingStep) -> None:
        step.schedule_running()
        step.admit_waiting(whole_prompts=True, reserve_outputs=True)
