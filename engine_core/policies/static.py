"""Static (request-level) batching: a batch runs until its last member ends.

Runs in the engine-core process. A batch of up to ``max_num_seqs`` whole prompts is admitted only
when the previous batch has fully ended; members that finish early leave, but nobody joins until
all have finished. Blocks for every member's outputs are reserved at admission, as a padded batch
tensor would hold them. This is the baseline the conveyor exists to beat.
"""

from __future__ import annotations

from conveyor.engine_core.policies.base import SchedulingPolicy, SchedulingStep


class StaticPolicy(SchedulingPolicy):
    name = "static"

    def schedule(self, step: SchedulingStep) -> None:
        if step.num_running > 0:
            step.schedule_running()
        else:
            step.admit_waiting(whole_prompts=True, reserve_outputs=True)
