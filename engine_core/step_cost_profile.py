"""The engine's start-up profile: made-up requests whose steps teach the step-cost model.

Runs in the engine-core process, once, before any client's request, when a TBT SLO is set
(``EngineCore`` drives it; ``StepBudget.begin_profile`` makes each step's prompt work follow the
script instead of the clock). A dozen steps: a few short requests that decode for different
numbers of steps, so the steps hold different numbers of decodes, ahead of long prompts that
take whatever prompt tokens the script gives each step, so chunk sizes and attention spans vary.
About five large steps' work in all (a second or two of a small model on a CPU).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from conveyor.protocol import SchedulerConfig

# The profile's prompt tokens per step, as fractions of its largest step: small and large steps
# in no order, so the fit tells the per-step, per-token and attention costs apart. The first two
# warm the caches and are not learned from. About 5 large steps' work in all.
PROFILE_FRACTIONS = (1 / 16, 1 / 16, 1 / 2, 1 / 8, 1, 1 / 4, 3 / 4, 1 / 32, 3 / 8, 1, 5 / 8, 1 / 16)
PROFILE_NUM_COLD = 2
# The profile's largest step: a CPU step of 2048 tokens of a small model takes most of a second.
PROFILE_MAX_STEP_TOKENS = 1024
PROFILE_NUM_DECODERS = 8


@dataclass
class ProfileWorkload:
    """Made-up requests (prompt, max_tokens) and the prompt tokens of each profile step."""

    requests: list[tuple[list[int], int]] = field(default_factory=list)
    script: list[int] = field(default_factory=list)
    num_cold: int = PROFILE_NUM_COLD


def profile_workload(config: SchedulerConfig, vocab_size: int, pool_tokens: int) -> ProfileWorkload:
    """The requests and the script; long prompts fit the context and half the KV pool."""
    largest = max(1, min(config.max_num_batched_tokens, PROFILE_MAX_STEP_TOKENS))
    script = [max(1, int(largest * f)) for f in PROFILE_FRACTIONS]
    rng = random.Random(0)
    workload = ProfileWorkload(script=script)
    short_len = max(1, min(8, config.max_model_len // 4))
    num_short = max(1, min(PROFILE_NUM_DECODERS, config.max_num_seqs - 1))
    for i in range(num_short):
        max_tokens = 2 + i * len(script) // num_short
        workload.requests.append(
            ([rng.randrange(vocab_size) for _ in range(short_len)], max_tokens)
        )
    left = sum(script) - num_short * short_len
    longest = max(1, min(config.max_model_len - 1, pool_tokens // 2, 4 * largest))
    while left > 0:
        length = min(left, longest)
        workload.requests.append(([rng.randrange(vocab_size) for _ in range(length)], 1))
        left -= length
    return workload
