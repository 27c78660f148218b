"""Prefill-first batching (vLLM V0, nano-vllm): a step is all prefill or all decode.

Runs in the engine-core process. Whenever a waiting prompt fits whole, the step runs only new
prompts (as many as fit) and every running request waits a step; otherwise the step is only
decodes. Time to first token is short; decodes stall whenever prompts keep arriving.
"""

from __future__ import annotations

from conveyor.engine_core.policies.base import SchedulingPolicy, SchedulingStep


class PrefillFirstPolicy(SchedulingPolicy):
    name = "prefill-first"

    def schedule(self, step: SchedulingStep) -> None:
        if step.admit_waiting(whole_prompts=True) == 0:
            step.schedule_running()
