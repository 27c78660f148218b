"""Each step's size under a TBT SLO: prompt chunks sized from the step-cost model's prediction.

Runs in the engine-core process, inside the scheduler (``SchedulerConfig.tbt_slo_ms``). A client
waits one step for each token it streams, so while any request decodes a step must not take
longer than the inter-token latency promised to clients. The scheduler still serves the running
requests first; every prompt chunk (a running request's next chunk, a waiting prompt admitted)
then asks ``chunk`` how many tokens it may have: the largest number whose predicted step time
stays within the SLO divided by ``noise_quantile``, and never fewer than
``slo_min_chunk_tokens`` for the step's first chunk, so prompts always progress.
That one may break the SLO when the decodes alone nearly fill it; its step is then marked
``over_slo="min-chunk"`` (``"decodes"`` when the decodes alone are predicted over). With no
request decoding there is no inter-token latency to keep: a step may take the whole token budget.

Every executed step's measured time comes back through ``observe``, which refits the model and
keeps the counts ``SchedulerStats`` exports (prediction error, steps over the SLO). What the
model cannot predict is measured: ``noise_quantile`` is the 99th percentile of measured /
predicted time over the last 128 steps predicted at half the SLO or more (the steps a limit
could be hit by; a small step's hiccup of a few milliseconds says nothing about them), so that
99 % of the steps a decode waits for fit in the SLO, as a p99 TBT SLO asks, however noisy the
machine. A window rather than a running estimate lets a quiet spell after a noisy one widen
the steps again within about a hundred steps.

At start-up the engine runs a short profile through ``begin_profile`` (``step_cost_profile``):
steps whose prompt work follows a script instead of the clock, so the model has seen small and
large steps before the first client's step is sized by it.

The features of a step are counted without a pass over its requests: a decode at context L reads
L + 1 keys, so the decodes' attention pairs are ``sum(num_computed_tokens) + tokens`` over the
plan's cached entries (one C-level sum), and each prompt chunk adds what that formula misses.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass

from conveyor.engine_core.step_cost import StepCostModel
from conveyor.engine_core.step_plan import StepPlan
from conveyor.protocol import SchedulerConfig

# The noise allowance: this quantile of measured / predicted over the last _WINDOW steps whose
# prediction was at least _NOISE_SHARE of the SLO.
_QUANTILE = 0.99
_WINDOW = 128
_NOISE_SHARE = 0.5

MIN_CHUNK = "min-chunk"
DECODES = "decodes"
UNFITTED = "unfitted"


@dataclass(slots=True)
class StepPrediction:
    """What one executed step held, what the model predicted and what it measured."""

    num_prefill_tokens: int
    num_decode_tokens: int
    num_attention_pairs: int
    num_reqs: int
    # None while the model has seen too few steps to predict.
    predicted_s: float | None
    # The tokens this step could have held within the SLO (max_num_batched_tokens when no
    # request decodes; during the profile, the script's prompt tokens plus the decodes).
    token_budget: int
    # Why a step with decodes was predicted over the SLO: MIN_CHUNK, DECODES or UNFITTED.
    over_slo: str | None = None
    # False for the profile's first steps (cold caches): measured, not learned from.
    fit: bool = True
    # One of the start-up profile's steps.
    profile: bool = False
    measured_s: float = -1.0


class StepBudget:
    """The TBT SLO's side of the scheduler: sizes prompt chunks, learns from measured steps."""

    def __init__(self, config: SchedulerConfig, model: StepCostModel | None = None) -> None:
        if config.tbt_slo_ms is None:
            raise ValueError("StepBudget needs SchedulerConfig.tbt_slo_ms")
        self.slo_s = config.tbt_slo_ms / 1e3
        self.min_chunk = config.slo_min_chunk_tokens
        self.max_tokens = config.max_num_batched_tokens
        self.model = model if model is not None else StepCostModel()
        # Scheduled, not yet measured, oldest first (at most two with async scheduling; the cap
        # only matters to a scheduler driven without an engine that reports step times).
        self._pending: deque[StepPrediction] = deque(maxlen=8)
        self.noise_quantile = 1.0
        self._ratios: deque[float] = deque()
        self._sorted_ratios: list[float] = []
        # The profile: prompt tokens per step, and how many first steps not to learn from.
        self._script: deque[int] | None = None
        self._num_cold = 0
        # The step being scheduled.
        self._plan = StepPlan(0)
        self._limit_s = self.slo_s
        self._allowance: int | None = None
        self._num_chunks = 0
        self._forced = False
        self._new_tokens = 0
        self._extra_pairs = 0
        # Cumulative, for SchedulerStats: steps predicted and measured, the sum of their
        # |measured - predicted| and of their measured times, and steps with decodes that
        # took longer than the SLO.
        self.num_steps_timed = 0
        self.abs_error_s = 0.0
        self.timed_s = 0.0
        self.num_steps_over_slo = 0

    # ------------------------------------------------------------------ the start-up profile

    def begin_profile(self, script: list[int], num_cold: int) -> None:
        """Until ``end_profile``: step i's prompt work is ``script[i]`` tokens, whatever the
        clock says; the first ``num_cold`` steps are measured but not learned from."""
        self._script = deque(script)
        self._num_cold = num_cold

    def end_profile(self) -> None:
        self._script = None
        self.model.set_prior_from_fit()

    # ------------------------------------------------------------------ one step

    def start_step(self, plan: StepPlan) -> None:
        self._plan = plan
        self._num_chunks = 0
        self._forced = False
        self._new_tokens = 0
        self._extra_pairs = 0
        if self._script is not None:
            # Past the script (a preemption made the work outlast it): no limit, so it ends.
            self._allowance = self._script.popleft() if self._script else self.max_tokens
        else:
            self._allowance = None
            self._limit_s = self.slo_s / max(1.0, self.noise_quantile)

    def chunk(self, start: int, wanted: int) -> int:
        """How many of ``wanted`` prompt tokens (from position ``start``) this step may take."""
        if self._allowance is not None:
            return min(wanted, self._allowance)
        plan = self._plan
        if plan.num_generated_tokens == 0 or not self.model.ready:
            return wanted  # nobody waits between tokens (or nothing to predict with yet)
        fit = self.model.max_prompt_chunk(self._predict(plan), start, self._limit_s)
        if fit >= wanted:
            return wanted
        if fit >= self.min_chunk:
            return int(fit)
        if self._num_chunks == 0:
            # Prompts must progress: the step's first chunk gets the minimum even past the SLO.
            self._forced = True
            return min(wanted, self.min_chunk)
        return 0

    def took(self, start: int, num_tokens: int, in_cached: bool) -> None:
        """A chunk ``chunk`` sized went into the plan (as a cached entry or a new request)."""
        pairs = num_tokens * start + num_tokens * (num_tokens + 1) // 2
        if in_cached:
            # The plan-wide formula counts this entry as start + num_tokens already.
            self._extra_pairs += pairs - start - num_tokens
        else:
            self._extra_pairs += pairs
            self._new_tokens += num_tokens
        self._num_chunks += 1
        if self._allowance is not None:
            self._allowance -= num_tokens

    def took_drafts(self, start: int, num_tokens: int) -> None:
        """A running request's last token and its drafts (``num_tokens`` from ``start``, a
        cached entry): the attention pairs the plan-wide formula, which counts a decode as one
        query, leaves out."""
        pairs = num_tokens * start + num_tokens * (num_tokens + 1) // 2
        self._extra_pairs += pairs - start - num_tokens

    def finish_step(self) -> StepPrediction:
        """The scheduled step (with tokens) goes to the workers: predict it, keep it to learn."""
        plan, model = self._plan, self.model
        pairs = self._pairs(plan)
        num_prefill, num_decode = plan.num_prompt_tokens, plan.num_generated_tokens
        num_reqs = len(plan.new_reqs) + len(plan.cached.req_ids)
        predicted = model.predict(num_prefill, num_decode, pairs, num_reqs) if model.ready else None
        over_slo, budget = None, self.max_tokens
        if self._allowance is not None:
            budget = num_decode + num_prefill + self._allowance
        elif num_decode and predicted is None:
            over_slo = UNFITTED
        elif num_decode and predicted is not None:
            if predicted > self.slo_s:
                over_slo = MIN_CHUNK if self._forced else DECODES
            room = model.max_prompt_chunk(predicted, 0, self._limit_s)
            budget = min(self.max_tokens, num_prefill + num_decode + int(min(room, 1e9)))
        fit = True
        if self._script is not None and self._num_cold > 0:
            self._num_cold -= 1
            fit = False
        step = StepPrediction(
            num_prefill,
            num_decode,
            pairs,
            num_reqs,
            predicted,
            budget,
            over_slo,
            fit,
            profile=self._script is not None,
        )
        self._pending.append(step)
        return step

    def _predict(self, plan: StepPlan) -> float:
        num_reqs = len(plan.new_reqs) + len(plan.cached.req_ids)
        return self.model.predict(
            plan.num_prompt_tokens, plan.num_generated_tokens, self._pairs(plan), num_reqs
        )

    def _pairs(self, plan: StepPlan) -> int:
        """The step's attention (query, key) pairs so far."""
        cached = plan.cached
        if plan.num_preemptions:
            # A preemption took entries back out of the plan: count them one by one (rare).
            return sum(
                n * c + n * (n + 1) // 2
                for c, n in zip(cached.num_computed_tokens, cached.num_scheduled_tokens)
            ) + sum(
                r.num_scheduled_tokens * r.num_computed_tokens
                + r.num_scheduled_tokens * (r.num_scheduled_tokens + 1) // 2
                for r in plan.new_reqs
            )
        num_cached_tokens = plan.num_prompt_tokens + plan.num_generated_tokens - self._new_tokens
        return sum(cached.num_computed_tokens) + num_cached_tokens + self._extra_pairs

    # ------------------------------------------------------------------ after the step ran

    def _track_noise(self, ratio: float) -> None:
        # A sorted copy of the window, kept by insertion and removal (a few µs at 128).
        ratios, ordered = self._ratios, self._sorted_ratios
        ratios.append(ratio)
        bisect.insort(ordered, ratio)
        if len(ratios) > _WINDOW:
            del ordered[bisect.bisect_left(ordered, ratios.popleft())]
        # The 2nd largest of 128: the ratio 99 % of the window's steps kept within.
        self.noise_quantile = ordered[
            min(len(ordered) - 1, math.ceil(_QUANTILE * len(ordered)) - 1)
        ]

    def observe(self, measured_s: float) -> StepPrediction:
        """The oldest scheduled step took ``measured_s``: learn from it, count its error."""
        step = self._pending.popleft()
        step.measured_s = measured_s
        if step.fit:
            self.model.observe(
                step.num_prefill_tokens,
                step.num_decode_tokens,
                step.num_attention_pairs,
                step.num_reqs,
                measured_s,
            )
        if step.predicted_s is not None:
            self.num_steps_timed += 1
            self.abs_error_s += abs(measured_s - step.predicted_s)
            self.timed_s += measured_s
            if step.predicted_s >= _NOISE_SHARE * self.slo_s:
                self._track_noise(measured_s / step.predicted_s)
        if self._script is None and step.num_decode_tokens and measured_s > self.slo_s:
            self.num_steps_over_slo += 1
        return step
