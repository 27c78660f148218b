"""Stall-free batching (Sarathi-Serve, vLLM V1): the default policy.

Runs in the engine-core process. Running requests are served first, so every decode gets its
token every step however long the prompts waiting behind it are; the budget left goes to waiting
requests, and a prompt that does not fit is chunked across steps.
"""

from __future__ import annotations

from conveyor.engine_core.policies.base import SchedulingPolicy, SchedulingStep


class StallFreePolicy(SchedulingPolicy):
    name = "stall-free"

    def schedule(self, step: SchedulingStep) -> None:
        step.schedule_running()
        # A preemption means blocks are short: admitting now would only take them back from the
        # requests just kept running, and thrash.
        if step.num_preemptions == 0:
            step.admit_waiting(whole_prompts=False)
