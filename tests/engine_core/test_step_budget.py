"""--tbt-slo-ms: steps sized from the step-cost model, against a synthetic executor whose step time
follows a known formula on a synthetic clock (no sleeping: every run here takes milliseconds)."""

from __future__ import annotations

import random
import statistics

import pytest

from conveyor.engine_core import EngineCore
from conveyor.engine_core.step_budget import DECODES, MIN_CHUNK, StepPrediction
from conveyor.engine_core.step_trace import read_trace
from conveyor.protocol import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    EngineCoreRequest,
    ModelConfig,
    ObservabilityConfig,
    SamplingParams,
    SchedulerConfig,
    check_engine_config,
)
from tests.fake_executor import TimedFakeExecutor

VOCAB = 100


class Run:
    """An engine on a TimedFakeExecutor, and every step's prediction after the profile."""

    def __init__(self, slo_ms: float, *, noise: float = 0.0, trace: str | None = None, **options):
        scheduler = dict(max_num_batched_tokens=1024, max_model_len=2048, max_num_seqs=32)
        scheduler.update(options.pop("scheduler", {}))
        config = EngineConfig(
            model=ModelConfig(
                model="fake", architecture="Fake", vocab_size=VOCAB, max_model_len=2048
            ),
            cache=CacheConfig(block_size=16, enable_prefix_caching=False),
            scheduler=SchedulerConfig(tbt_slo_ms=slo_ms, **scheduler),
            observability=ObservabilityConfig(trace_steps=trace),
        )
        check_engine_config(config)
        self.executor = TimedFakeExecutor(options.pop("num_blocks", 2000), VOCAB, 16, noise=noise)
        self.engine = EngineCore(config, self.executor, step_clock=self.executor.clock)
        self.num_profile_steps = len(self.executor.true_seconds)
        self.predictions: list[StepPrediction] = []
        observe = self.engine.scheduler.observe_step_time

        def recording(measured_s: float) -> StepPrediction | None:
            prediction = observe(measured_s)
            assert prediction is not None
            self.predictions.append(prediction)
            return prediction

        self.engine.scheduler.observe_step_time = recording  # type: ignore[method-assign]
        self.rng = random.Random(0)
        self.num_sent = 0

    def send(self, prompt_len: int, max_tokens: int) -> None:
        prompt = [self.rng.randrange(VOCAB) for _ in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(EngineCoreRequest(str(self.num_sent), prompt, params, 0.0))
        self.num_sent += 1

    def serve(self, num_requests: int, steps_between: int = 3, on_step=None) -> None:
        """Requests of random lengths arriving every few steps, run until all are done."""
        for _ in range(num_requests):
            self.send(self.rng.randrange(50, 1500), self.rng.randrange(5, 60))
            for _ in range(steps_between):
                self.step(on_step)
        while self.engine.has_unfinished_requests():
            self.step(on_step)
        self.engine.check_all_free()

    def step(self, on_step=None) -> None:
        self.engine.step()
        if on_step is not None:
            on_step(self)

    @property
    def truths(self) -> list[float]:
        """The formula's time of each step after the profile (what was predicted)."""
        return self.executor.true_seconds[self.num_profile_steps :]

    def errors(self) -> list[float]:
        return [
            abs(p.predicted_s - t) / t
            for p, t in zip(self.predictions, self.truths, strict=True)
            if p.predicted_s is not None
        ]


def test_after_the_profile_the_model_predicts_each_step_within_10_percent():
    run = Run(slo_ms=60.0, noise=0.03)
    assert run.engine.scheduler.step_budget.model.ready, "the start-up profile fitted it"
    assert run.num_profile_steps >= 12
    run.serve(60)
    errors = run.errors()
    assert len(errors) == len(run.predictions) > 200
    assert statistics.mean(errors) < 0.03
    assert sorted(errors)[int(0.95 * len(errors))] < 0.10
    stats = run.engine.scheduler.make_stats()
    assert stats.num_steps_timed >= len(errors)
    assert 0 < stats.step_time_abs_error_s / stats.step_time_s < 0.05


def test_a_machine_that_slows_down_mid_run_is_learned_again():
    run = Run(slo_ms=60.0, noise=0.03)

    def slow_down(r: Run) -> None:
        if len(r.predictions) == 100:
            r.executor.slowdown = 1.5

    run.serve(80, on_step=slow_down)
    errors = run.errors()
    assert max(errors[100:103]) > 0.3, "the change was a surprise"
    assert statistics.mean(errors[140:]) < 0.05
    assert sorted(errors[140:])[int(0.95 * len(errors[140:]))] < 0.10


def test_no_step_with_decodes_is_predicted_over_the_slo_and_prompts_still_progress():
    slo_ms = 60.0
    run = Run(slo_ms=slo_ms)
    run.send(1400, 5)  # arrives at an idle engine: nobody decodes yet
    run.serve(60, steps_between=2)
    with_decodes = [p for p in run.predictions if p.num_decode_tokens]
    assert all(p.predicted_s <= slo_ms / 1e3 for p in with_decodes)
    assert all(p.over_slo is None for p in with_decodes)
    # Noise-free steps measure what the model predicted (within its error of a percent or
    # two), so none took much longer either.
    assert all(p.measured_s <= 1.02 * slo_ms / 1e3 for p in with_decodes)
    over = run.engine.scheduler.make_stats().num_steps_over_tbt_slo
    assert over == sum(p.measured_s > slo_ms / 1e3 for p in with_decodes) < 0.02 * len(with_decodes)
    # The SLO did the sizing: chunks well below the token budget rode along with decodes, and
    # steps without decodes took a whole budget's worth of prompt.
    chunked = [p for p in with_decodes if p.num_prefill_tokens]
    assert len(chunked) > 50
    assert max(p.num_prefill_tokens + p.num_decode_tokens for p in chunked) < 400
    assert all(p.token_budget < 1024 for p in with_decodes)
    alone = [p.num_prefill_tokens for p in run.predictions if not p.num_decode_tokens]
    assert max(alone) == 1024 and max(alone) * 3e-4 > slo_ms / 1e3


def test_noise_the_model_cannot_predict_is_budgeted_for():
    # 10 % of noise on every step: the budget leaves room for the 99th percentile of it, so
    # about 1 % of the steps with decodes (fewer: not all of them are full) break the SLO.
    chunks = {}
    for noise in (0.0, 0.1):
        run = Run(slo_ms=60.0, noise=noise)
        run.serve(100, steps_between=2)
        with_decodes = [p for p in run.predictions if p.num_decode_tokens]
        over = sum(p.measured_s > 0.060 for p in with_decodes)
        assert over <= 0.02 * len(with_decodes)
        prompt = [p.num_prefill_tokens for p in with_decodes if p.num_prefill_tokens]
        chunks[noise] = statistics.mean(prompt)
        quantile = run.engine.scheduler.step_budget.noise_quantile
    assert 1.15 < quantile < 1.4
    assert chunks[0.1] < 0.85 * chunks[0.0]


def test_when_the_decodes_leave_no_room_the_minimum_chunk_goes_anyway_and_the_trace_says_so(
    tmp_path,
):
    trace = tmp_path / "steps.jsonl"
    # 30 decodes alone take about 16 ms of this 20 ms SLO: the minimum chunk (32 tokens,
    # about 10 ms) does not fit beside them, but each step still takes one.
    run = Run(slo_ms=20.0, trace=str(trace), scheduler=dict(max_num_seqs=31))
    for _ in range(30):
        run.send(8, 400)
    for _ in range(5):
        run.step()
    for _ in range(3):
        run.send(300, 2)
    while run.engine.has_unfinished_requests():
        run.step()
    run.engine.check_all_free()
    run.engine.shutdown()
    records = read_trace(trace)
    profile = [r for r in records if r.profile]
    assert len(profile) == run.num_profile_steps and records[: len(profile)] == profile
    served = records[len(profile) :]
    assert all(r.predicted_ms is not None and r.token_budget is not None for r in served)
    forced = [r for r in served if r.over_slo == MIN_CHUNK]
    assert forced, "the minimum chunk was never forced"
    assert all(0 < r.num_prefill_tokens <= 32 and r.predicted_ms > 20.0 for r in forced)
    assert sum(r.num_prefill_tokens for r in served) == 8 * 30 + 3 * 300
    for r in served:
        if r.num_decode_tokens and r.predicted_ms > 20.0:
            assert r.over_slo in (MIN_CHUNK, DECODES), r


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_step_features_counted_without_a_pass_are_the_executors(async_scheduling):
    # A pool small enough for preemptions (whose steps are counted the slow, exact way).
    run = Run(slo_ms=60.0, num_blocks=140, scheduler=dict(async_scheduling=async_scheduling))
    run.serve(40, steps_between=2)
    assert run.engine.scheduler.make_stats().num_preemptions > 0
    executed = run.executor.step_features[run.num_profile_steps :]
    counted = [
        (p.num_prefill_tokens, p.num_decode_tokens, p.num_attention_pairs, p.num_reqs)
        for p in run.predictions
    ]
    assert counted == executed


def test_a_tbt_slo_needs_a_chunking_policy_and_a_positive_value():
    def config(**scheduler) -> EngineConfig:
        model = ModelConfig(model="fake", architecture="Fake", vocab_size=VOCAB, max_model_len=64)
        return EngineConfig(model=model, scheduler=SchedulerConfig(max_model_len=64, **scheduler))

    with pytest.raises(ConfigError, match="stall-free"):
        check_engine_config(config(tbt_slo_ms=50.0, policy="orca", max_num_batched_tokens=64))
    with pytest.raises(ConfigError, match="tbt_slo_ms"):
        check_engine_config(config(tbt_slo_ms=0.0))
    check_engine_config(config(tbt_slo_ms=50.0))
