"""A model-free executor that mirrors requests from the diffs exactly as a real worker must.

Runs in the test process, standing in for the workers. It keeps each request's token history and
block table from the ``SchedulerOutput`` diffs alone (prompt from new requests, the tokens it
sampled itself, history replaced on resume), asserts every diff is consistent with what it already
knows, and simulates the paged KV cache slot by slot: each scheduled position writes its token into
``block_ids[pos // block_size]``, and every position a request attends to must hold that request's
own token, so a wrong block table, a bad prefix-cache hit or a block shared while written fails
here. The "model" samples a deterministic function of the full history, so a request produces the
same tokens however it was batched, chunked or preempted. ``make_scheduler`` and ``run_step`` drive
a bare Scheduler with it the way EngineCore.step does.
"""

from __future__ import annotations

import random
import zlib
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from conveyor.engine_core.scheduler import Scheduler
from conveyor.executor.abstract import InlineExecutor
from conveyor.protocol import (
    CacheConfig,
    EngineCoreOutputs,
    Logprobs,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
)
from conveyor.protocol.messages import reaches_workers


def fake_next_token(token_ids: list[int], vocab_size: int) -> int:
    """The fake model: the next token is a hash of the whole history."""
    return zlib.crc32(array("q", token_ids).tobytes()) % vocab_size


@dataclass
class _Mirror:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    in_batch: bool = True


class FakeExecutor(InlineExecutor):
    """Mirrors, checks and "runs" each step; keeps every SchedulerOutput it ran for inspection."""

    def __init__(
        self,
        num_blocks: int,
        vocab_size: int,
        block_size: int = 16,
        check_kv: bool = True,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_blocks = num_blocks
        # A model whose every layer sees only the last sliding_window tokens: reads are checked
        # within the window only (what lies behind it may be freed and reused).
        self.sliding_window = sliding_window
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.check_kv = check_kv
        self.initialized_num_blocks: int | None = None
        self.mirrors: dict[int, _Mirror] = {}
        # Simulated KV: which token each slot of each block holds.
        self.kv: dict[int, list[int | None]] = {}
        self.scheduler_outputs: list[SchedulerOutput] = []
        self.num_shutdowns = 0

    def determine_num_blocks(self) -> int:
        return self.num_blocks

    def kv_sliding_window(self) -> int | None:
        return self.sliding_window

    def initialize_cache(self, num_blocks: int) -> None:
        assert self.initialized_num_blocks is None, "initialize_cache called twice"
        self.initialized_num_blocks = num_blocks

    def shutdown(self) -> None:
        self.num_shutdowns += 1

    def run_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.initialized_num_blocks is not None, "a step before initialize_cache"
        assert reaches_workers(scheduler_output), "an empty step was executed"
        if self.scheduler_outputs:
            assert scheduler_output.step_id > self.scheduler_outputs[-1].step_id
        self.scheduler_outputs.append(scheduler_output)
        self._drop_left(scheduler_output)
        scheduled = self._apply_new(scheduler_output) + self._apply_cached(scheduler_output)
        req_ids = [req_id for req_id, _ in scheduled]
        assert len(set(req_ids)) == len(req_ids), f"a request scheduled twice: {req_ids}"
        total = sum(num_tokens for _, num_tokens in scheduled)
        assert total == scheduler_output.total_num_scheduled_tokens
        for req_id, num_tokens in scheduled:
            self._check_and_write(req_id, num_tokens)
        if self.check_kv:
            for req_id, num_tokens in scheduled:
                self._check_reads(req_id, num_tokens)
        output = self._sample(scheduler_output.step_id, scheduled)
        # Grammars "build" at once: their requests may be scheduled from the next step.
        output.grammars_ready = list(scheduler_output.grammar_req_ids)
        return output

    def _drop_left(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            assert req_id in self.mirrors, f"finished req {req_id} was never sent"
            del self.mirrors[req_id]
        for req_id in scheduler_output.preempted_req_ids:
            assert self.mirrors[req_id].in_batch, f"req {req_id} preempted twice"
            self.mirrors[req_id].in_batch = False

    def _apply_new(self, scheduler_output: SchedulerOutput) -> list[tuple[int, int]]:
        scheduled = []
        for new in scheduler_output.scheduled_new_reqs:
            assert new.req_id not in self.mirrors, f"req {new.req_id} sent as new twice"
            self.mirrors[new.req_id] = _Mirror(
                list(new.prompt_token_ids),
                list(new.block_ids),
                new.num_computed_tokens,
                new.sampling_params,
            )
            scheduled.append((new.req_id, new.num_scheduled_tokens))
        return scheduled

    def _apply_cached(self, scheduler_output: SchedulerOutput) -> list[tuple[int, int]]:
        cached = scheduler_output.scheduled_cached_reqs
        scheduled = []
        for i, req_id in enumerate(cached.req_ids):
            mirror = self.mirrors[req_id]
            if req_id in cached.resumed_token_ids:
                assert not mirror.in_batch, f"req {req_id} resumed without being preempted"
                mirror.token_ids = list(cached.resumed_token_ids[req_id])
                mirror.block_ids = list(cached.new_block_ids[i])
                mirror.num_computed_tokens = cached.num_computed_tokens[i]
                mirror.in_batch = True
            else:
                assert mirror.in_batch, f"req {req_id} scheduled while preempted"
                assert cached.num_computed_tokens[i] == mirror.num_computed_tokens, (
                    f"req {req_id}: engine says {cached.num_computed_tokens[i]} computed, "
                    f"worker has {mirror.num_computed_tokens}"
                )
                mirror.block_ids.extend(cached.new_block_ids[i])
            scheduled.append((req_id, cached.num_scheduled_tokens[i]))
        return scheduled

    def _check_and_write(self, req_id: int, num_tokens: int) -> None:
        mirror = self.mirrors[req_id]
        start, end = mirror.num_computed_tokens, mirror.num_computed_tokens + num_tokens
        assert num_tokens >= 1, f"req {req_id} scheduled for {num_tokens} tokens"
        assert end <= len(mirror.token_ids), f"req {req_id} scheduled past its known tokens"
        assert len(mirror.block_ids) * self.block_size >= end, f"req {req_id}: block table short"
        assert all(0 <= b < self.num_blocks for b in mirror.block_ids), mirror.block_ids
        size = self.block_size
        for pos in range(start, end):
            block = self.kv.setdefault(mirror.block_ids[pos // size], [None] * size)
            block[pos % size] = mirror.token_ids[pos]

    def _check_reads(self, req_id: int, num_tokens: int) -> None:
        # Attention over every position up to the last computed one must see this request's
        # own tokens: anything else is someone else's KV.
        mirror, size = self.mirrors[req_id], self.block_size
        first = 0
        if self.sliding_window is not None:
            first = max(0, mirror.num_computed_tokens - self.sliding_window + 1)
        for pos in range(first, mirror.num_computed_tokens + num_tokens):
            held = self.kv.get(mirror.block_ids[pos // size], [None] * size)[pos % size]
            assert held == mirror.token_ids[pos], (
                f"req {req_id} position {pos}: KV holds {held}, expected {mirror.token_ids[pos]}"
            )

    def _sample(self, step_id: int, scheduled: list[tuple[int, int]]) -> ModelRunnerOutput:
        output = ModelRunnerOutput(step_id=step_id)
        wants_logprobs = False
        for req_id, num_tokens in scheduled:
            mirror = self.mirrors[req_id]
            mirror.num_computed_tokens += num_tokens
            if mirror.num_computed_tokens < len(mirror.token_ids):
                continue  # a prompt chunk: nothing to sample yet
            token = fake_next_token(mirror.token_ids, self.vocab_size)
            mirror.token_ids.append(token)
            output.req_ids.append(req_id)
            output.sampled_token_ids.append(token)
            wants_logprobs |= mirror.sampling_params.logprobs is not None
        if wants_logprobs:
            tokens = output.sampled_token_ids
            output.logprobs = Logprobs(
                token_ids=[[t] for t in tokens],
                logprobs=[[-float(t % 7)] for t in tokens],
                ranks=[1 + t % 3 for t in tokens],
            )
        return output


# ---------------------------------------------------------------- driving a scheduler with it


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    vocab_size: int = 50,
    enable_prefix_caching: bool = True,
    sliding_window: int | None = None,
    **scheduler_options: object,
) -> tuple[Scheduler, FakeExecutor]:
    """A scheduler over a pool of num_blocks, and a fake executor with the same block size."""
    scheduler_options.setdefault("max_model_len", 512)
    cache_config = CacheConfig(
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
        num_blocks=num_blocks,
        sliding_window=sliding_window,
    )
    scheduler = Scheduler(SchedulerConfig(**scheduler_options), cache_config)  # type: ignore[arg-type]
    executor = FakeExecutor(num_blocks, vocab_size, block_size, sliding_window=sliding_window)
    return scheduler, executor


def run_step(
    scheduler: Scheduler, executor: FakeExecutor
) -> tuple[SchedulerOutput, dict[int, EngineCoreOutputs]]:
    """schedule -> execute -> update, as EngineCore.step does (no execution for an empty step)."""
    scheduler_output = scheduler.schedule()
    if not reaches_workers(scheduler_output):
        runner_output = ModelRunnerOutput(step_id=scheduler_output.step_id)
    else:
        if executor.initialized_num_blocks is None:
            executor.initialize_cache(executor.num_blocks)
        runner_output = executor.execute_model(scheduler_output)
    return scheduler_output, scheduler.update_from_output(scheduler_output, runner_output)


class OverlappedSteps:
    """Drives a bare Scheduler as EngineCore does with async scheduling: one step in flight.

    Each ``step`` submits the next step before folding in the oldest one, so the scheduler
    decides while a step's tokens are still unknown. The fake executor runs a step when it is
    submitted, which the scheduler cannot see: it only ever learns tokens in ``update_from_output``.
    """

    def __init__(self, scheduler: Scheduler, executor: FakeExecutor) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.in_flight: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
        if executor.initialized_num_blocks is None:
            executor.initialize_cache(executor.num_blocks)

    def _submit(self, scheduler_output: SchedulerOutput) -> bool:
        if not reaches_workers(scheduler_output):
            return False
        self.in_flight.append((scheduler_output, self.executor.execute_model(scheduler_output)))
        return True

    def step(
        self, check: Callable[[SchedulerOutput], None] | None = None
    ) -> dict[int, EngineCoreOutputs]:
        """One call of the overlapped loop; ``check`` sees each step the moment it is scheduled."""
        check = check or (lambda _: None)
        if not self.in_flight:
            first = self.scheduler.schedule()
            check(first)
            if not self._submit(first):
                empty = ModelRunnerOutput(step_id=first.step_id)
                return self.scheduler.update_from_output(first, empty)
        following = self.scheduler.schedule()
        check(following)
        self._submit(following)
        done, runner_output = self.in_flight.pop(0)
        return self.scheduler.update_from_output(done, runner_output)


# ---------------------------------------------------------------- steps that take known time


@dataclass
class StepCostFormula:
    """A step's time as a known function of what it holds (the synthetic executor's truth)."""

    fixed_s: float = 0.004
    per_prefill_token_s: float = 0.0003
    per_decode_token_s: float = 0.00035
    # Per (query, key) pair attention reads: n * start + n (n + 1) / 2 for n tokens from start.
    per_pair_s: float = 2e-8
    per_req_s: float = 0.0001

    def seconds(self, num_prefill: int, num_decode: int, num_pairs: int, num_reqs: int) -> float:
        return (
            self.fixed_s
            + self.per_prefill_token_s * num_prefill
            + self.per_decode_token_s * num_decode
            + self.per_pair_s * num_pairs
            + self.per_req_s * num_reqs
        )


class SyntheticClock:
    """A clock only the synthetic executor moves: step times are exact and tests never sleep."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedFakeExecutor(FakeExecutor):
    """A FakeExecutor whose every step advances a SyntheticClock by the formula's time, times
    ``slowdown`` (a test raises it mid-run to make the machine drift), times seeded noise, and
    now and then (``outlier_rate``) ``outlier_factor`` times that."""

    def __init__(
        self,
        num_blocks: int,
        vocab_size: int,
        block_size: int = 16,
        formula: StepCostFormula | None = None,
        noise: float = 0.0,
        outlier_rate: float = 0.0,
        outlier_factor: float = 4.0,
        seed: int = 0,
    ) -> None:
        super().__init__(num_blocks, vocab_size, block_size, check_kv=False)
        self.formula = formula or StepCostFormula()
        self.clock = SyntheticClock()
        self.noise = noise
        self.outlier_rate = outlier_rate
        self.outlier_factor = outlier_factor
        self.slowdown = 1.0
        self._rng = random.Random(seed)
        self._prompt_lens: dict[int, int] = {}
        self._durations: deque[float] = deque()
        # Per executed step: (prefill tokens, decode tokens, attention pairs, requests) and the
        # formula's time without noise.
        self.step_features: list[tuple[int, int, int, int]] = []
        self.true_seconds: list[float] = []

    def run_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for new in scheduler_output.scheduled_new_reqs:
            self._prompt_lens[new.req_id] = len(new.prompt_token_ids)
        entries = [
            (new.req_id, new.num_computed_tokens, new.num_scheduled_tokens)
            for new in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        entries += zip(cached.req_ids, cached.num_computed_tokens, cached.num_scheduled_tokens)
        prefill = decode = pairs = 0
        for req_id, start, n in entries:
            pairs += n * start + n * (n + 1) // 2
            if start >= self._prompt_lens[req_id]:
                decode += n
            else:
                prefill += n
        features = (prefill, decode, pairs, len(entries))
        true_s = self.slowdown * self.formula.seconds(*features)
        self.step_features.append(features)
        self.true_seconds.append(true_s)
        seconds = true_s
        if self.noise:
            seconds *= 1.0 + self._rng.gauss(0.0, self.noise)
        if self.outlier_rate and self._rng.random() < self.outlier_rate:
            seconds *= self.outlier_factor  # another process took the core for a while
        self._durations.append(seconds)
        return super().run_step(scheduler_output)

    def wait_for_output(self) -> ModelRunnerOutput:
        # The clock moves when the step is waited for, not when it is submitted: with async
        # scheduling the next step is submitted first, as it is while real workers run one.
        self.clock.now += self._durations.popleft()
        return super().wait_for_output()
