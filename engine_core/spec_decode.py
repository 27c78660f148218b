"""Speculative decoding as the scheduler sees it: draft tokens are tokens.

Runs in the engine-core process. The workers propose each request's drafts right after they
sample its tokens (they hold the tokens; a proposer that runs a model must live there anyway) and
report them in ``ModelRunnerOutput.spec_token_ids``; this class keeps them until the request's
next step. Scheduled, the drafts take token budget and KV slots like any other tokens and travel
in ``SchedulerOutput.scheduled_spec_decode_tokens``; ``num_computed_tokens`` advances over them
optimistically. When the step returns, a request with ``a`` of its ``k`` drafts accepted got
``a + 1`` tokens, and ``num_computed_tokens`` moves back by the ``k - a`` rejected ones: their KV
slots are written again by the request's next step.

The KV blocks that held rejected drafts stay the request's (its next step's drafts need them at
once; they go with it when it finishes or is preempted) and are never registered in the prefix
cache: the KV manager registers only blocks full of the request's known tokens.

Async scheduling: a request's drafts come from its latest token, so they can only be scheduled
once its previous step is back. A request speculating is therefore never run ahead (scheduled
again while its token is in flight); it is scheduled again once the step's result and its new
drafts are known. Planning with an optimistic accept count and correcting it would keep the
overlap, at the price of positions the workers must shift after the fact; the simple rule is
exact, and costs the overlap only while speculation is on, i.e. at small batches (see
``disable_by_batch_size``), where a step is short and the overlap small.

Backing off: a request whose drafts keep being rejected (text nothing copies) pays for verifying
k positions that yield nothing. After two draft steps in a row with nothing accepted, the request
gets no drafts for its next 2, then 4, 8, ... up to ``MAX_BACKOFF_STEPS`` steps; an accepted
draft ends the back-off. The cost of useless drafts is then a few percent of the steps.

Structured requests speculate too: the worker's grammar matcher cuts each draft at the first
token the grammar refuses, masks every verified position, and advances over the emitted tokens
only (worker/spec_decode/spec_step.py).
"""

from __future__ import annotations

from conveyor.engine_core.request import Request, RequestStatus
from conveyor.protocol import ModelRunnerOutput, SchedulerOutput
from conveyor.protocol.speculative import MAX_BACKOFF_STEPS, SpeculativeConfig

_RUNNING = RequestStatus.RUNNING


class SpecDecodeScheduling:
    """The drafts waiting for each request's next step, and the acceptance counters."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.max_batch = config.disable_by_batch_size
        # KV slots reserved past a speculating request's scheduled tokens (a draft model's own
        # drafts' KV); 0 for ngram.
        self.lookahead = config.num_lookahead_tokens
        # req_id -> (the request's num_tokens when the drafts were proposed, the drafts): a
        # draft is only valid right after the token it was proposed from.
        self._drafts: dict[int, tuple[int, list[int]]] = {}
        # Cumulative, as vLLM's spec_decode counters.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * config.num_speculative_tokens
        # Rejected drafts since the engine started: scheduled as generated tokens, never output.
        self.num_rejected_tokens = 0
        # req_id -> draft steps in a row that accepted nothing, and steps left without drafts.
        self._misses: dict[int, int] = {}
        self._paused: dict[int, int] = {}

    def active(self, num_running: int) -> bool:
        """Whether a step with this many running requests carries drafts (the off-switch)."""
        return num_running <= self.max_batch

    def take_drafts(self, request: Request, budget_left: int) -> list[int]:
        """The drafts to schedule after the request's one token to compute, within what the
        step's budget and the request's max_tokens leave; [] if none are valid."""
        entry = self._drafts.pop(request.req_id, None)
        paused = self._paused.get(request.req_id)
        if paused:
            # Counted in the request's steps, proposals or not: a draft model's worker pauses
            # by the same rule (worker/spec_decode/spec_step.py) and proposes nothing meanwhile.
            self._paused[request.req_id] = paused - 1
            return []
        if entry is None:
            return []
        num_tokens, drafts = entry
        if num_tokens != len(request.all_token_ids):
            return []
        # The step yields at most len(drafts) + 1 tokens: never more than max_tokens allows.
        room = request.max_tokens - request.num_output_tokens - 1
        if budget_left - 1 < room:
            room = budget_left - 1
        return drafts[:room] if room > 0 else []

    def forget(self, req_id: int) -> None:
        self._drafts.pop(req_id, None)
        self._misses.pop(req_id, None)
        self._paused.pop(req_id, None)

    def _back_off(self, req_id: int, num_accepted: int) -> None:
        if num_accepted:
            self._misses.pop(req_id, None)
            return
        misses = self._misses.get(req_id, 0) + 1
        self._misses[req_id] = misses
        if misses >= 2:
            self._paused[req_id] = min(1 << (misses - 1), MAX_BACKOFF_STEPS)

    def roll_back(
        self,
        requests: dict[int, Request],
        scheduler_output: SchedulerOutput,
        runner_output: ModelRunnerOutput,
    ) -> None:
        """Count each scheduled draft's fate and move ``num_computed_tokens`` back over the
        rejected ones; before the tokens are folded in (a request that ends on an accepted
        token must be freed with its real count)."""
        scheduled = scheduler_output.scheduled_spec_decode_tokens
        if not scheduled:
            return
        counts = runner_output.num_sampled_tokens
        for i, req_id in enumerate(runner_output.req_ids):
            drafts = scheduled.get(req_id)
            if drafts is None:
                continue
            num_accepted = (counts[i] if counts else 1) - 1
            num_rejected = len(drafts) - num_accepted
            self.num_drafts += 1
            self.num_draft_tokens += len(drafts)
            self.num_accepted_tokens += num_accepted
            self.num_rejected_tokens += num_rejected
            for pos in range(num_accepted):
                self.accepted_per_pos[pos] += 1
            self._back_off(req_id, num_accepted)
            request = requests.get(req_id)
            # A request preempted (or ended) while the step ran has num_computed_tokens reset.
            if request is not None and request.status is _RUNNING:
                request.num_computed_tokens -= num_rejected

    def record_proposals(
        self, requests: dict[int, Request], runner_output: ModelRunnerOutput
    ) -> None:
        """Keep the drafts the workers proposed, for each request's next step."""
        proposals = runner_output.spec_token_ids
        if not proposals:
            return
        for req_id, drafts in zip(runner_output.req_ids, proposals):
            request = requests.get(req_id)
            if drafts and request is not None and request.status is _RUNNING:
                self._drafts[req_id] = (len(request.all_token_ids), drafts)
            else:
                self._drafts.pop(req_id, None)
