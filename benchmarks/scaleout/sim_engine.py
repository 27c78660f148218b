"""One simulated engine: the real scheduler and KV cache manager, a fitted clock, no model.

Runs in the benchmark's own process. Each step is what ``EngineCore.step`` does without async
scheduling: the real ``Scheduler`` (prefix caching, chunked prefill, preemption) decides the
step, the step takes the time the fitted step-cost model gives for what it holds, and a stand-in
sampler produces one token for every request whose prompt is complete. Tokens are drawn at
random: the router and the prefix cache see only prompts, which the workload builds from the
tokens the engine really returned.
"""

from __future__ import annotations

import random

from benchmarks.scaleout.step_cost_fit import StepCost
from conveyor.engine_core import Request, Scheduler
from conveyor.engine_core.step_trace import attention_pairs
from conveyor.protocol import (
    CacheConfig,
    EngineCoreOutputs,
    ModelRunnerOutput,
    SchedulerConfig,
    SchedulerOutput,
    SchedulerStats,
)


class SimEngine:
    """A scheduler with a virtual clock; ``step`` returns how long the step took."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        cost: StepCost,
        vocab_size: int,
        seed: int,
    ) -> None:
        self.scheduler = Scheduler(scheduler_config, cache_config)
        self.cost = cost
        self.vocab_size = vocab_size
        self._rng = random.Random(seed)
        # What the workers would mirror: each request's token count and computed tokens.
        self._num_tokens: dict[int, int] = {}
        self.busy = False
        self.num_steps = 0

    def add_request(self, request: Request) -> None:
        self._num_tokens[request.req_id] = len(request.prompt_token_ids)
        self.scheduler.add_request(request)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def schedule(self) -> tuple[SchedulerOutput, float]:
        """The next step and how long it will take (0 when it holds nothing)."""
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.total_num_scheduled_tokens == 0:
            return scheduler_output, 0.0
        stats = self.scheduler.make_stats()
        num_reqs = len(scheduler_output.scheduled_new_reqs) + len(
            scheduler_output.scheduled_cached_reqs.req_ids
        )
        duration = self.cost(
            stats.step_num_prefill_tokens,
            stats.step_num_decode_tokens,
            attention_pairs(scheduler_output),
            num_reqs,
        )
        self.num_steps += 1
        return scheduler_output, duration

    def finish(self, scheduler_output: SchedulerOutput) -> dict[int, EngineCoreOutputs]:
        """The step's tokens: folded into the scheduler, which returns the clients' outputs."""
        return self.scheduler.update_from_output(scheduler_output, self._sample(scheduler_output))

    def stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def _sample(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        output = ModelRunnerOutput(step_id=scheduler_output.step_id)
        num_tokens = self._num_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for req_id in cached.resumed_token_ids:
            num_tokens[req_id] = len(cached.resumed_token_ids[req_id])
        for req_id in scheduler_output.finished_req_ids:
            num_tokens.pop(req_id, None)
        done = [
            (new.req_id, new.num_computed_tokens + new.num_scheduled_tokens)
            for new in scheduler_output.scheduled_new_reqs
        ]
        done += [
            (req_id, computed + scheduled)
            for req_id, computed, scheduled in zip(
                cached.req_ids, cached.num_computed_tokens, cached.num_scheduled_tokens
            )
        ]
        for req_id, computed in done:
            if computed >= num_tokens[req_id]:  # the prompt is in: one token out
                num_tokens[req_id] += 1
                output.req_ids.append(req_id)
                output.sampled_token_ids.append(self._rng.randrange(self.vocab_size))
        return output
