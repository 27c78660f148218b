"""The token-budget scheduler: who runs how many tokens each step, and what came of it.

Runs in the engine-core process. A request is two counters (``num_tokens``, ``num_computed_tokens``);
each step has a token budget and a width cap. A policy (``engine_core/policies``) decides the order
of two moves, serving running requests and admitting waiting ones; this class carries them out:
it allocates blocks, preempts by recompute when they run out, builds the diff the workers apply
(``SchedulerOutput``) and folds the sampled tokens back in (``update_from_output``). Under a TBT
SLO (``tbt_slo_ms``) every prompt chunk waits until the step's decodes are in and then gets the
size ``StepBudget`` (``step_budget.py``) finds for the time the SLO leaves.

With async scheduling, step N+1 is scheduled while step N runs, before N's tokens are known. A
request whose every known token is already computed (its next token is still in flight) then gets
one token anyway: the workers feed it the token they sampled in step N. The two counters say
everything: ``num_computed_tokens == num_tokens`` means exactly one token is in flight. A request
whose in-flight token is certainly its last (``max_tokens``, the context) is not run ahead; one
that ends on a stop token is run one step too far, and that step's token is dropped, because
``update_from_output`` only keeps tokens of requests it has not finished.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable

from conveyor.engine_core.kv_cache_manager import KVCacheManager
from conveyor.engine_core.lora_slots import LoRASlotTable
from conveyor.engine_core.output_collector import OutputCollector
from conveyor.engine_core.policies import make_policy
from conveyor.engine_core.request import Request, RequestStatus
from conveyor.engine_core.request_queue import make_request_queue, priority_key
from conveyor.engine_core.spec_decode import SpecDecodeScheduling
from conveyor.engine_core.step_budget import StepBudget, StepPrediction
from conveyor.engine_core.step_plan import StepPlan
from conveyor.protocol import (
    ITERATION_TOKENS_BUCKETS,
    CacheConfig,
    EngineCoreOutputs,
    ModelRunnerOutput,
    SchedulerConfig,
    SchedulerOutput,
    SchedulerStats,
)
from conveyor.protocol.lora import LoRAConfig
from conveyor.protocol.messages import reaches_workers

_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED
_POOL_TOO_SMALL = "needs more KV cache blocks than the whole pool holds"
# While requests wait only for their grammars, a step of no tokens lets a worker wait this long
# for a build to finish: the engine polls without spinning, and answers within it.
GRAMMAR_POLL_S = 0.05


class Scheduler:
    """Decides each step's batch under a token budget and a width cap; implements SchedulingStep."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        lora_config: LoRAConfig | None = None,
    ) -> None:
        if cache_config.num_blocks is None:
            raise ValueError("cache_config.num_blocks must be set (learned from the workers)")
        self.config = scheduler_config
        self.kv_cache_manager = KVCacheManager(
            cache_config.num_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            cache_config.sliding_window,
        )
        self.policy = make_policy(scheduler_config.policy)
        self.waiting = make_request_queue(scheduler_config.queue_order)
        # In admission order: the last one is the newest (the FCFS preemption victim).
        self.running: list[Request] = []
        # Every unfinished request, waiting or running.
        self.requests: dict[int, Request] = {}
        threshold = scheduler_config.long_prefill_token_threshold
        self._chunk_cap = threshold if threshold > 0 else scheduler_config.max_num_batched_tokens
        self._by_priority = scheduler_config.queue_order == "priority"
        # Under a TBT SLO each prompt chunk is sized by the step-cost model once the decodes
        # are in, so schedule_running holds back every request wanting more than one token.
        self.step_budget = StepBudget(scheduler_config) if scheduler_config.tbt_slo_ms else None
        self._run_ahead = scheduler_config.async_scheduling
        # Speculative decoding: drafts are scheduled as tokens (engine_core/spec_decode.py).
        spec = scheduler_config.speculative
        self.spec = SpecDecodeScheduling(spec) if spec is not None else None
        self._spec_active = False
        # Requests the workers mirror: sent as new, not yet sent as finished.
        self._worker_req_ids: set[int] = set()
        # Waiting for the next step that reaches the workers.
        self._finished_req_ids: list[int] = []
        self._preempted_req_ids: list[int] = []
        # Preempted while this step was scheduled: not re-admitted before the next one, as a
        # token of theirs may still be in flight (async scheduling) and must be known first.
        self._preempted_now: set[int] = set()
        # Structured requests whose matchers the workers are building: admitted to ``waiting``
        # when a worker says the grammar is ready, so a large grammar never holds up a step.
        self._waiting_for_grammar: dict[int, Request] = {}
        self._grammars_to_send: list[Request] = []
        self._outputs = OutputCollector()
        # LoRA adapters in the workers' slots (None: base model only): admission caps the
        # adapters running at once, and a request's first admission may schedule a slot load.
        self.lora_slots = LoRASlotTable(lora_config.max_loras) if lora_config else None
        self._plan = StepPlan(0)
        self._step_id = 0
        self._num_preemptions = 0
        # Cumulative step counts for SchedulerStats: steps with tokens, their prompt and
        # generated tokens, and steps per tokens-per-step bucket.
        self._num_steps = 0
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._iteration_tokens = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        if request.req_id in self.requests:
            raise ValueError(f"req_id {request.req_id} is already scheduled")
        request.status = RequestStatus.WAITING
        request.queued_time = time.monotonic()
        self.requests[request.req_id] = request
        if request.sampling_params.grammar:
            self._waiting_for_grammar[request.req_id] = request
            self._grammars_to_send.append(request)
        else:
            self.waiting.add(request)

    def abort_requests(self, req_ids: Iterable[int]) -> None:
        """End the given requests; unknown or already finished ids are ignored."""
        aborted = {req_id: self.requests[req_id] for req_id in req_ids if req_id in self.requests}
        if not aborted:
            return
        self._remove_unfinished(aborted)
        for request in aborted.values():
            self._end(request, RequestStatus.FINISHED_ABORTED)

    def _remove_unfinished(self, gone: dict[int, Request]) -> None:
        """Take these requests out of whichever list or queue holds them."""
        if any(r.status is _RUNNING for r in gone.values()):
            self.running = [r for r in self.running if r.req_id not in gone]
        for req_id in gone.keys() & self._waiting_for_grammar.keys():
            del self._waiting_for_grammar[req_id]
            self._grammars_to_send = [r for r in self._grammars_to_send if r.req_id != req_id]
        self.waiting.remove_requests([r for r in gone.values() if r.status is not _RUNNING])

    def fail_requests(self, req_ids: list[int], reasons: list[str]) -> None:
        """End the given requests with an "error" finish and its reason (the workers could not
        go on with them); unknown or already finished ids are ignored."""
        failed = {
            req_id: (self.requests[req_id], reason)
            for req_id, reason in zip(req_ids, reasons)
            if req_id in self.requests
        }
        if not failed:
            return
        self._remove_unfinished({req_id: request for req_id, (request, _) in failed.items()})
        for request, reason in failed.values():
            self._end(request, RequestStatus.FINISHED_ERROR, reason)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_pending_outputs(self) -> bool:
        """Outputs of aborted or failed requests wait for the next ``update_from_output``."""
        return bool(self._outputs)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        self._step_id += 1
        self._plan = StepPlan(self.config.max_num_batched_tokens)
        if self._preempted_now:
            self._preempted_now.clear()
        if self.step_budget is not None:
            self.step_budget.start_step(self._plan)
        self._spec_active = self.spec is not None and self.spec.active(len(self.running))
        self.policy.schedule(self)
        self._count_step(self._plan)
        output = self._plan.to_output(self._step_id)
        if self.step_budget is not None and output.total_num_scheduled_tokens > 0:
            self.step_budget.finish_step()
        for new_request in output.scheduled_new_reqs:
            self._worker_req_ids.add(new_request.req_id)
        if self._grammars_to_send:
            output.grammar_req_ids = [r.req_id for r in self._grammars_to_send]
            output.grammars = [r.sampling_params.grammar or "" for r in self._grammars_to_send]
            self._grammars_to_send = []
        elif self._waiting_for_grammar and output.total_num_scheduled_tokens == 0:
            output.grammar_wait_s = GRAMMAR_POLL_S
        if self.lora_slots is not None:
            output.lora_loads = self.lora_slots.take_loads()
        # A step with nothing for the workers is not executed: its ids wait for one that is.
        if reaches_workers(output):
            output.finished_req_ids, self._finished_req_ids = self._finished_req_ids, []
            output.preempted_req_ids, self._preempted_req_ids = self._preempted_req_ids, []
        return output

    def _count_step(self, plan: StepPlan) -> None:
        num_tokens = plan.num_prompt_tokens + plan.num_generated_tokens
        if num_tokens:
            self._num_steps += 1
            self._num_prompt_tokens += plan.num_prompt_tokens
            self._num_generation_tokens += plan.num_generated_tokens
            self._iteration_tokens[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, num_tokens)] += 1

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_preempted_waiting(self) -> int:
        """Waiting requests that ran before and were preempted; O(waiting)."""
        return sum(1 for r in self.waiting if r.status is _PREEMPTED)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self._waiting_for_grammar)

    @property
    def num_preemptions(self) -> int:
        return self._plan.num_preemptions

    def schedule_running(self) -> None:
        plan, kv, cap = self._plan, self.kv_cache_manager, self._chunk_cap
        held_back: list[Request] | None = None
        if self.step_budget is not None:
            cap, held_back = 1, []
        for request in list(self.running):  # a copy: preemption removes from self.running
            budget = plan.token_budget
            if budget <= 0:
                break
            if request.status is not _RUNNING:  # preempted earlier in this loop
                continue
            # Comparisons rather than min(): this runs for every running request every step.
            num_tokens = len(request.all_token_ids) - request.num_computed_tokens
            if num_tokens > cap:
                if held_back is not None:  # a prompt chunk under the TBT SLO: sized below
                    held_back.append(request)
                    continue
                num_tokens = cap
            if num_tokens > budget:
                num_tokens = budget
            elif num_tokens <= 0:
                # Its next token is in flight (async scheduling): run one step ahead on it,
                # unless that token is certainly its last, or its drafts wait for that token.
                if not self._run_ahead or num_tokens < 0 or not _may_run_ahead(request):
                    continue
                if self._spec_active:
                    continue
                num_tokens = 1
            drafts = None
            lookahead = 0
            if self._spec_active and num_tokens == 1:
                drafts = self.spec.take_drafts(request, budget)  # type: ignore[union-attr]
                num_tokens += len(drafts)
                # A draft model writes its next drafts' KV past this step's tokens.
                lookahead = self.spec.lookahead  # type: ignore[union-attr]
            new_block_ids = kv.allocate_slots(request, num_tokens, num_reserved_tokens=lookahead)
            if new_block_ids is None:
                new_block_ids = self._allocate_or_preempt(request, num_tokens, lookahead)
                if new_block_ids is None:
                    continue
            plan.add_cached(request, num_tokens, new_block_ids)
            if drafts:
                plan.spec_tokens[request.req_id] = drafts
                if self.step_budget is not None:
                    start = request.num_computed_tokens - num_tokens
                    self.step_budget.took_drafts(start, num_tokens)
        if held_back:
            self._schedule_chunks_under_slo(held_back)

    def _schedule_chunks_under_slo(self, requests: list[Request]) -> None:
        """The running requests' prompt chunks, each as large as the step's predicted time
        allows now that every decode of the step is in."""
        plan, step_budget = self._plan, self.step_budget
        assert step_budget is not None
        for request in requests:
            if plan.token_budget <= 0:
                break
            if request.status is not _RUNNING:  # preempted for another one's blocks
                continue
            start = request.num_computed_tokens
            wanted = min(len(request.all_token_ids) - start, self._chunk_cap, plan.token_budget)
            num_tokens = step_budget.chunk(start, wanted)
            if num_tokens <= 0:
                continue
            new_block_ids = self.kv_cache_manager.allocate_slots(request, num_tokens)
            if new_block_ids is None:
                new_block_ids = self._allocate_or_preempt(request, num_tokens)
                if new_block_ids is None:
                    continue
            plan.add_cached(request, num_tokens, new_block_ids)
            step_budget.took(start, num_tokens, in_cached=True)

    def admit_waiting(self, *, whole_prompts: bool, reserve_outputs: bool = False) -> int:
        num_admitted = 0
        while (
            self.waiting
            and self._plan.token_budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting.peek()
            if request.req_id in self._preempted_now:
                break
            if self._try_admit(request, whole_prompts, reserve_outputs):
                num_admitted += 1
            elif not request.is_finished:  # head-of-line: nobody overtakes the head
                break
        return num_admitted

    def _try_admit(self, request: Request, whole_prompt: bool, reserve_outputs: bool) -> bool:
        kv = self.kv_cache_manager
        if self.lora_slots is not None and not self.lora_slots.can_admit(request):
            return False  # one adapter too many for the slots: waits (head-of-line)
        hit_block_ids, num_hit_tokens = kv.get_computed_blocks(request)
        num_needed = request.num_tokens - num_hit_tokens
        if whole_prompt and num_needed > self.config.max_num_batched_tokens:
            # This policy never chunks, and no step can hold it: waiting would never end.
            self._fail_waiting(
                request,
                f"needs {num_needed} tokens in one step; policy {self.config.policy!r} does not "
                f"chunk and max_num_batched_tokens is {self.config.max_num_batched_tokens}",
            )
            return False
        if whole_prompt and num_needed > self._plan.token_budget:
            return False
        num_tokens = num_needed if whole_prompt else min(num_needed, self._chunk_cap)
        num_tokens = min(num_tokens, self._plan.token_budget)
        if self.step_budget is not None:
            num_tokens = self.step_budget.chunk(num_hit_tokens, num_tokens)
            if num_tokens <= 0:
                return False  # the step's predicted time is spent: nobody overtakes the head
        num_reserved = request.max_tokens - request.num_output_tokens if reserve_outputs else 0
        new_block_ids = kv.allocate_slots(
            request, num_tokens, hit_block_ids, num_hit_tokens, num_reserved
        )
        if new_block_ids is None:
            if not self.running:  # the whole pool is free and still too small: never fits
                self._fail_waiting(request, _POOL_TOO_SMALL)
            return False
        self.waiting.pop()
        request.status = _RUNNING
        if request.first_scheduled_time < 0:
            request.first_scheduled_time = time.monotonic()
        request.num_computed_tokens = num_hit_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
        self.running.append(request)
        if self.lora_slots is not None:
            self.lora_slots.acquire(request)
        # A request that held no blocks gets its whole table here, as the workers need it.
        resumed = request.req_id in self._worker_req_ids
        if resumed:
            self._plan.add_cached(request, num_tokens, new_block_ids, resumed=True)
        else:
            self._plan.add_new(request, num_tokens, new_block_ids)
        if self.step_budget is not None:
            self.step_budget.took(num_hit_tokens, num_tokens, in_cached=resumed)
        return True

    def _allocate_or_preempt(
        self, request: Request, num_tokens: int, num_reserved_tokens: int = 0
    ) -> list[int] | None:
        """Preempt until the request's blocks fit; None if the request itself had to go."""
        while True:
            new_block_ids = self.kv_cache_manager.allocate_slots(
                request, num_tokens, num_reserved_tokens=num_reserved_tokens
            )
            if new_block_ids is not None:
                return new_block_ids
            victim = max(self.running, key=priority_key) if self._by_priority else self.running[-1]
            if victim is request and len(self.running) == 1:
                # Alone with the whole pool and still short: recomputing would never end.
                self.running.clear()
                self._end(request, RequestStatus.FINISHED_ERROR, _POOL_TOO_SMALL)
                return None
            self._preempt(victim)
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        if self.lora_slots is not None:
            self.lora_slots.release(request)
        self._plan.discard(request)
        # Free before the reset: the KV manager reads num_computed_tokens to keep what is valid.
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._plan.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.add_preempted(request)
        self._preempted_now.add(request.req_id)
        if request.req_id in self._worker_req_ids:
            self._preempted_req_ids.append(request.req_id)

    def _fail_waiting(self, request: Request, reason: str) -> None:
        self.waiting.remove_requests([request])
        self._end(request, RequestStatus.FINISHED_ERROR, reason)

    def _end(self, request: Request, status: RequestStatus, reason: str | None = None) -> None:
        """Finish a request the model did not finish (abort, error): free it, tell everyone."""
        request.status = status
        request.stop_reason = reason
        self._release(request)
        self._outputs.add_final(request)

    def _release(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        if self.spec is not None:
            self.spec.forget(request.req_id)
        if self.lora_slots is not None:
            self.lora_slots.release(request)
        del self.requests[request.req_id]
        if request.req_id in self._worker_req_ids:
            self._worker_req_ids.discard(request.req_id)
            self._finished_req_ids.append(request.req_id)
            # Preempted in a step that had no tokens, then finished by the token that was in
            # flight (async scheduling): its preemption never reached the workers, and telling
            # them both would ask them to drop one mirror twice.
            if self._preempted_req_ids and request.req_id in self._preempted_req_ids:
                self._preempted_req_ids.remove(request.req_id)

    # ------------------------------------------------------------------ after the step ran

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """Append each sampled token, stop what is done; outputs grouped by client_index."""
        for req_id in model_runner_output.grammars_ready:
            request = self._waiting_for_grammar.pop(req_id, None)
            if request is not None:
                self.waiting.add(request)
        if model_runner_output.failed_req_ids:
            self.fail_requests(
                model_runner_output.failed_req_ids, model_runner_output.failure_reasons
            )
        spec = self.spec
        if spec is not None:
            rejected = spec.num_rejected_tokens
            spec.roll_back(self.requests, scheduler_output, model_runner_output)
            # Drafts counted as generated tokens when scheduled; only accepted ones are.
            self._num_generation_tokens -= spec.num_rejected_tokens - rejected
        finished = self._outputs.add_sampled(self.requests, model_runner_output)
        if spec is not None:
            spec.record_proposals(self.requests, model_runner_output)
        if finished:
            num_running = len(self.running)
            self.running = [r for r in self.running if r.status is _RUNNING]
            if num_running - len(self.running) < len(finished):
                # Preempted while its last step ran (async scheduling): it ends from the queue.
                self.waiting.remove_requests(finished)
            for request in finished:
                self._release(request)
        return self._outputs.take(self.make_stats(), time.monotonic())

    def observe_step_time(self, measured_s: float) -> StepPrediction | None:
        """The oldest executed step took ``measured_s`` (from when the workers could start it
        until its output was folded in); the step-cost model learns from it under a TBT SLO."""
        return self.step_budget.observe(measured_s) if self.step_budget is not None else None

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        stats = SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self._waiting_for_grammar),
            kv_cache_usage=kv.usage,
            num_preemptions=self._num_preemptions,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            step_num_prefill_tokens=self._plan.num_prompt_tokens,
            step_num_decode_tokens=self._plan.num_generated_tokens,
            num_steps=self._num_steps,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
            iteration_tokens=list(self._iteration_tokens),
        )
        if self.lora_slots is not None:
            stats.running_lora_adapters = _lora_names(self.running)
            stats.waiting_lora_adapters = _lora_names(self.waiting)
        step_budget = self.step_budget
        if step_budget is not None:
            stats.num_steps_timed = step_budget.num_steps_timed
            stats.step_time_abs_error_s = step_budget.abs_error_s
            stats.step_time_s = step_budget.timed_s
            stats.num_steps_over_tbt_slo = step_budget.num_steps_over_slo
        spec = self.spec
        if spec is not None:
            stats.spec_num_drafts = spec.num_drafts
            stats.spec_num_draft_tokens = spec.num_draft_tokens
            stats.spec_num_accepted_tokens = spec.num_accepted_tokens
            stats.spec_accepted_per_pos = list(spec.accepted_per_pos)
        return stats

    def check_all_free(self) -> None:
        """AssertionError unless no request is left anywhere and every KV block is free."""
        if self.requests or self.running or self.waiting:
            raise AssertionError(
                f"requests left: {len(self.requests)} unfinished, {len(self.running)} running, "
                f"{len(self.waiting)} waiting"
            )
        self.kv_cache_manager.check_all_free()


def _lora_names(requests: Iterable[Request]) -> list[str]:
    return sorted({r.lora.lora_name for r in requests if r.lora is not None})


def _may_run_ahead(request: Request) -> bool:
    """Whether the token in flight may not be the request's last (so the next one is wanted)."""
    return request.num_output_tokens + 1 < request.max_tokens
