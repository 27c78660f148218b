"""The engine core: one step is schedule -> execute -> update.

Runs in the engine-core process. Sockets, threads and polling live in the process wrapper around
this class; here a request arrives as a message, a step returns messages, and a bad request is
answered with an error output instead of an exception, so one client cannot stop the engine for
everyone.

With ``async_scheduling`` a step keeps the workers busy while the engine thinks: it schedules and
submits step N+1 before waiting for step N, then folds N's tokens in and returns, so the update,
the outputs and the next schedule all overlap the workers' forward pass. At most one step is in
flight between calls. An executor without workers to wait for (``InlineExecutor``) runs a step at
submission, which gives the same tokens without the overlap.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from msgspec.structs import replace

from conveyor.engine_core.request import Request
from conveyor.engine_core.scheduler import Scheduler
from conveyor.engine_core.step_cost_profile import profile_workload
from conveyor.engine_core.step_trace import StepTracer
from conveyor.executor.abstract import Executor
from conveyor.protocol import (
    EngineConfig,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
)
from conveyor.protocol.lora import AdapterError, LoRARequest, read_adapter
from conveyor.protocol.messages import reaches_workers
from conveyor.protocol.sampling_params import find_vocab_problem

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns the scheduler and drives the executor one step at a time."""

    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        step_clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``step_clock`` times the steps (tests give one a synthetic executor advances)."""
        self.config = config
        self.executor = executor
        self._clock = step_clock
        num_blocks = executor.determine_num_blocks()
        executor.initialize_cache(num_blocks)
        # A request may hold no more tokens than the whole pool: cap the context at it, so that
        # "until the context is full" ends with "length" rather than an out-of-blocks error, and
        # clients learn the real limit from the config in Ready.
        block_size = config.cache.block_size
        pool_tokens = (num_blocks - 1) * block_size  # block 0 is the null block
        sliding_window = executor.kv_sliding_window()
        if sliding_window is not None:
            # Behind a window a request holds at most the window and one step's chunk, so a pool
            # that fits that serves any context length.
            most_held = sliding_window - 1 + config.scheduler.max_num_batched_tokens
            if num_blocks - 1 >= -(-most_held // block_size) + 1:
                pool_tokens = config.scheduler.max_model_len
        if pool_tokens < config.scheduler.max_model_len:
            logger.warning(
                "the KV cache holds %d tokens (%d blocks), fewer than max_model_len %d: "
                "max_model_len is lowered to %d; give it more memory to serve longer contexts",
                pool_tokens,
                num_blocks - 1,
                config.scheduler.max_model_len,
                pool_tokens,
            )
            config = replace(config, scheduler=replace(config.scheduler, max_model_len=pool_tokens))
        # What clients learn in Ready: the pool's size and window too.
        cache = replace(config.cache, num_blocks=num_blocks, sliding_window=sliding_window)
        config = replace(config, cache=cache)
        self.config = config
        self.scheduler = Scheduler(config.scheduler, cache, config.lora)
        self._next_req_id = 0
        # The engine's id of each LoRA adapter it has seen, by LoRARequest.key (0: base model).
        self._lora_ids: dict[str, int] = {}
        # In-flight requests by (client_index, request_id): a frontend names its requests with
        # strings that are unique only among its own.
        self._requests: dict[tuple[int, str], Request] = {}
        self.async_scheduling = config.scheduler.async_scheduling
        # Submitted steps whose outputs have not been folded in yet, oldest first.
        self._in_flight: deque[SchedulerOutput] = deque()
        trace_path = config.observability.trace_steps
        self.tracer = StepTracer(trace_path, step_clock()) if trace_path else None
        # When each step in flight was submitted, and when the last one ended: a step's time
        # runs from when the workers could start it until its output is folded in.
        self._timed = self.tracer is not None or self.scheduler.step_budget is not None
        self._submit_times: deque[float] = deque()
        self._last_step_end = step_clock()
        if self.scheduler.step_budget is not None:
            self._profile_step_cost((num_blocks - 1) * block_size)

    def add_request(
        self, request: EngineCoreRequest, client_index: int = 0
    ) -> EngineCoreOutputs | None:
        """Queue a request; a request that cannot run comes back at once as an error output."""
        problem = self._find_problem(request, client_index)
        if problem is not None:
            output = EngineCoreOutput(request.request_id, [], "error", problem)
            return EngineCoreOutputs([output], time.monotonic())
        cap = self.config.scheduler.max_waiting_requests
        if cap is not None and self.scheduler.num_waiting >= cap:
            reason = f"the engine's queue is full ({cap} requests waiting); retry later"
            output = EngineCoreOutput(request.request_id, [], "rejected", reason)
            return EngineCoreOutputs([output], time.monotonic())
        scheduled = Request(
            self._next_req_id,
            request.prompt_token_ids,
            request.sampling_params,
            max_model_len=self.config.scheduler.max_model_len,
            request_id=request.request_id,
            client_index=client_index,
            eos_token_ids=request.eos_token_ids,
            arrival_time=request.arrival_time,
            priority=request.priority,
            cache_salt=request.cache_salt,
            lora=request.lora_request,
            lora_id=self._lora_ids.get(request.lora_request.key, 0) if request.lora_request else 0,
        )
        self._next_req_id += 1
        self._requests[(client_index, request.request_id)] = scheduled
        self.scheduler.add_request(scheduled)
        return None

    def _register_lora(self, lora: LoRARequest) -> str | None:
        """Give an adapter the engine has not seen an id, once its folder checks out (the
        workers then load it without surprises); what is wrong with it, or None."""
        if self.config.lora is None:
            return "this engine serves no LoRA adapters (start it with --enable-lora)"
        if lora.key in self._lora_ids:
            return None
        try:
            read_adapter(lora.lora_path, self.config.model.model, self.config.lora.max_lora_rank)
        except AdapterError as error:
            return f"LoRA adapter {lora.lora_name!r}: {error}"
        self._lora_ids[lora.key] = len(self._lora_ids) + 1
        return None

    def _find_problem(self, request: EngineCoreRequest, client_index: int) -> str | None:
        if request.lora_request is not None:
            problem = self._register_lora(request.lora_request)
            if problem is not None:
                return problem
        prompt = request.prompt_token_ids
        max_model_len = self.config.scheduler.max_model_len
        vocab_size = self.config.model.vocab_size
        if not prompt:
            return "the prompt is empty"
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            return f"prompt token ids must be in [0, {vocab_size})"
        max_logprobs = self.config.model.max_logprobs
        vocab_problem = find_vocab_problem(request.sampling_params, vocab_size, max_logprobs)
        if vocab_problem is not None:
            return vocab_problem
        if len(prompt) >= max_model_len:
            return (
                f"the prompt has {len(prompt)} tokens; it must be shorter than "
                f"max_model_len ({max_model_len}) to leave room for output"
            )
        if (client_index, request.request_id) in self._requests:
            return f"request_id {request.request_id!r} is already in flight"
        return None

    def abort_requests(self, request_ids: list[str], client_index: int = 0) -> None:
        """Abort by the client's ids; unknown or already finished ids are ignored."""
        req_ids = []
        for request_id in request_ids:
            # Forget the name now, so the client may reuse it before the abort output goes out.
            request = self._requests.pop((client_index, request_id), None)
            if request is not None:
                req_ids.append(request.req_id)
        self.scheduler.abort_requests(req_ids)

    def abort_client(self, client_index: int) -> int:
        """Abort every in-flight request of a client that left; returns how many."""
        request_ids = [rid for (index, rid) in self._requests if index == client_index]
        self.abort_requests(request_ids, client_index)
        return len(request_ids)

    def step(self) -> dict[int, EngineCoreOutputs]:
        """Run one step; outputs keyed by client_index."""
        if self.async_scheduling:
            return self._step_overlapped()
        return self._step_sync()

    def _step_sync(self) -> dict[int, EngineCoreOutputs]:
        scheduler_output = self.scheduler.schedule()
        if not reaches_workers(scheduler_output):
            # Nothing for the workers; outputs of aborted requests still go out.
            runner_output = ModelRunnerOutput(step_id=scheduler_output.step_id)
        else:
            self._step_submitted(scheduler_output)
            runner_output = self.executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if reaches_workers(scheduler_output):
            self._step_done(scheduler_output)
        self._forget_finished(outputs)
        return outputs

    def _step_overlapped(self) -> dict[int, EngineCoreOutputs]:
        """Submit the next step, then fold in the oldest one in flight; outputs by client."""
        scheduler = self.scheduler
        if not self._in_flight:
            first = scheduler.schedule()
            if not reaches_workers(first):
                outputs = scheduler.update_from_output(first, ModelRunnerOutput(first.step_id))
                self._forget_finished(outputs)
                return outputs
            self._submit(first)
        # Scheduled while the oldest step runs: its requests' next tokens are in flight.
        following = scheduler.schedule()
        if reaches_workers(following):
            self._submit(following)
        done = self._in_flight.popleft()
        outputs = scheduler.update_from_output(done, self.executor.wait_for_output())
        self._step_done(done)
        self._forget_finished(outputs)
        return outputs

    def _submit(self, scheduler_output: SchedulerOutput) -> None:
        self._step_submitted(scheduler_output)
        self.executor.submit_step(scheduler_output)
        self._in_flight.append(scheduler_output)

    def _step_submitted(self, scheduler_output: SchedulerOutput) -> None:
        if scheduler_output.total_num_scheduled_tokens == 0:
            return  # grammars to build or a poll for them: no step to time or trace
        if self._timed:
            self._submit_times.append(self._clock())
        if self.tracer is not None:
            self.tracer.step_submitted(scheduler_output, self.scheduler.make_stats())

    def _step_done(self, scheduler_output: SchedulerOutput) -> None:
        if not self._timed or scheduler_output.total_num_scheduled_tokens == 0:
            return
        now = self._clock()
        started = max(self._submit_times.popleft(), self._last_step_end)
        self._last_step_end = now
        prediction = self.scheduler.observe_step_time(now - started)
        if self.tracer is not None:
            self.tracer.step_done(self.scheduler.make_stats(), now, now - started, prediction)
            if not self.scheduler.has_unfinished_requests():
                self.tracer.flush()  # idle now: a reader sees every step so far

    def _profile_step_cost(self, pool_tokens: int) -> None:
        """Scripted steps of made-up requests before any client's, so the step-cost model has
        seen small and large steps before it sizes one (engine_core/step_cost_profile.py)."""
        step_budget = self.scheduler.step_budget
        assert step_budget is not None
        scheduler_config = self.config.scheduler
        workload = profile_workload(scheduler_config, self.config.model.vocab_size, pool_tokens)
        params = [
            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            for _, max_tokens in workload.requests
        ]
        for i, ((prompt, _), sampling) in enumerate(zip(workload.requests, params)):
            request = Request(
                self._next_req_id,
                prompt,
                sampling,
                max_model_len=scheduler_config.max_model_len,
                request_id=f"step-cost-profile-{i}",
            )
            self._next_req_id += 1
            self.scheduler.add_request(request)
        started = time.monotonic()
        step_budget.begin_profile(workload.script, workload.num_cold)
        num_steps = 0
        while self.scheduler.has_unfinished_requests():
            self._step_sync()  # the outputs are nobody's
            num_steps += 1
        step_budget.end_profile()
        coef = ", ".join(f"{c:.3g}" for c in step_budget.model.coef)
        logger.info(
            "step-cost profile: %d steps in %.2f s; model coefficients (s per unit) %s",
            num_steps,
            time.monotonic() - started,
            coef,
        )

    def _forget_finished(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        requests = self._requests
        for client_index, client_outputs in outputs.items():
            for output in client_outputs.outputs:
                if output.finish_reason is None:
                    continue
                key = (client_index, output.request_id)
                request = requests.get(key)
                # The name may already belong to a newer request (aborted, then reused).
                if request is not None and request.is_finished:
                    del requests[key]

    def has_unfinished_requests(self) -> bool:
        """True while a step would do something: requests to run or outputs to deliver."""
        return (
            self.scheduler.has_unfinished_requests()
            or self.scheduler.has_pending_outputs()
            or bool(self._in_flight)
        )

    def check_all_free(self) -> None:
        """AssertionError unless no request is left and every KV block is free."""
        self.scheduler.check_all_free()
        if self._in_flight:
            raise AssertionError(f"{len(self._in_flight)} steps still in flight")
        if self._requests:
            raise AssertionError(f"{len(self._requests)} request ids still mapped")

    def shutdown(self) -> None:
        if self.tracer is not None:
            self.tracer.close()
        self.executor.shutdown()
