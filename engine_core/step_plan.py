"""What one step runs: the diff for the workers, built as requests are scheduled.

Runs in the engine-core process. The scheduler adds each request to the plan the moment it gets
tokens: the plan records the request's entry with ``num_computed_tokens`` as it was before the
step, then advances it (optimistic: the step's tokens count as computed from the moment they are
sent, which is what lets a next step be scheduled before this one returns). Entries go straight
into the ``SchedulerOutput`` lists, as a decode step of hundreds of requests runs this for each.
"""

from __future__ import annotations

from conveyor.engine_core.request import Request
from conveyor.protocol import CachedRequestData, NewRequestData, SchedulerOutput


class StepPlan:
    """The scheduled requests of one step, the budget left, and token counts for stats."""

    __slots__ = (
        "token_budget",
        "num_preemptions",
        "num_prompt_tokens",
        "num_generated_tokens",
        "new_reqs",
        "cached",
        "spec_tokens",
    )

    def __init__(self, token_budget: int) -> None:
        self.token_budget = token_budget
        self.num_preemptions = 0
        # Tokens of a request whose prompt is computed are generated ones (decodes); the rest is
        # prompt work, including a preempted request recomputing its outputs.
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.new_reqs: list[NewRequestData] = []
        self.cached = CachedRequestData()
        # req_id -> the drafts scheduled after its last known token (speculative decoding).
        self.spec_tokens: dict[int, list[int]] = {}

    def add_new(self, request: Request, num_tokens: int, block_ids: list[int]) -> None:
        """A request the workers have no mirror of: all of it, sent once."""
        self.new_reqs.append(
            NewRequestData(
                req_id=request.req_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params,
                block_ids=block_ids,
                num_computed_tokens=request.num_computed_tokens,
                num_scheduled_tokens=num_tokens,
                lora_id=request.lora_id,
            )
        )
        self._advance(request, num_tokens)

    def add_cached(
        self, request: Request, num_tokens: int, new_block_ids: list[int], resumed: bool = False
    ) -> None:
        """A request the workers mirror: new block ids only, or everything if it was preempted."""
        cached = self.cached
        num_computed = request.num_computed_tokens
        if resumed:
            cached.resumed_token_ids[request.req_id] = list(request.all_token_ids)
        cached.req_ids.append(request.req_id)
        cached.new_block_ids.append(new_block_ids)
        cached.num_computed_tokens.append(num_computed)
        cached.num_scheduled_tokens.append(num_tokens)
        # _advance written out (one call less): this runs for every running request every step.
        if num_computed >= len(request.prompt_token_ids):
            self.num_generated_tokens += num_tokens
        else:
            self.num_prompt_tokens += num_tokens
        request.num_computed_tokens = num_computed + num_tokens
        self.token_budget -= num_tokens

    def _advance(self, request: Request, num_tokens: int) -> None:
        self._count(request, num_tokens)
        request.num_computed_tokens += num_tokens

    def _count(self, request: Request, num_tokens: int) -> None:
        """Spend (or, negative, give back) budget; sort the tokens for stats, as in add_cached."""
        if request.num_computed_tokens >= len(request.prompt_token_ids):
            self.num_generated_tokens += num_tokens
        else:
            self.num_prompt_tokens += num_tokens
        self.token_budget -= num_tokens

    def discard(self, request: Request) -> None:
        """Take a request back out (preempted after it was scheduled this step); O(plan)."""
        cached = self.cached
        if request.req_id not in cached.req_ids:
            return  # new requests are admitted after any preemption, so never discarded
        i = cached.req_ids.index(request.req_id)
        request.num_computed_tokens = cached.num_computed_tokens[i]
        self._count(request, -cached.num_scheduled_tokens[i])
        del cached.req_ids[i], cached.new_block_ids[i]
        del cached.num_computed_tokens[i], cached.num_scheduled_tokens[i]
        cached.resumed_token_ids.pop(request.req_id, None)
        self.spec_tokens.pop(request.req_id, None)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_generated_tokens

    def to_output(self, step_id: int) -> SchedulerOutput:
        return SchedulerOutput(
            step_id=step_id,
            scheduled_new_reqs=self.new_reqs,
            scheduled_cached_reqs=self.cached,
            total_num_scheduled_tokens=self.total_num_scheduled_tokens,
            scheduled_spec_decode_tokens=self.spec_tokens,
        )
