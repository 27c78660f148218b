"""The scale-out simulation: step-cost fit, workload, simulated engines behind the real router."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from benchmarks.scaleout import cli
from benchmarks.scaleout.sim_engine import SimEngine
from benchmarks.scaleout.simulate import SimConfig, Simulation
from benchmarks.scaleout.step_cost_fit import (
    BENCH_MODEL_COST,
    BENCH_TRACE,
    StepCost,
    fit_step_cost,
    fit_trace_file,
)
from benchmarks.scaleout.workload import Workload, WorkloadConfig
from conveyor.engine_core import Request
from conveyor.engine_core.step_trace import StepTraceRecord
from conveyor.protocol import CacheConfig, SamplingParams, SchedulerConfig

TRUE_COST = StepCost(4e-3, 3e-4, 5e-4, 2e-8, 1e-4)


def _record(step: int, prefill: int, decode: int, pairs: int, reqs: int, ms: float):
    return StepTraceRecord(
        step_id=step, time=float(step), duration_ms=ms, num_prefill_tokens=prefill,
        num_decode_tokens=decode, num_reqs=reqs, num_running=reqs, num_waiting=0,
        kv_cache_usage=0.0, num_preemptions=0, num_attention_pairs=pairs,
    )  # fmt: skip


def _random_step(rng: random.Random) -> tuple[int, int, int, int]:
    prefill, decode = rng.choice([0, rng.randint(1, 512)]), rng.randint(0, 64)
    pairs = decode * rng.randint(10, 2000) + prefill * rng.randint(0, 3000)
    return prefill, decode, pairs, decode + (prefill > 0)


def test_the_fit_predicts_a_known_step_cost_from_noisy_steps():
    rng = random.Random(0)
    records = []
    for step in range(400):
        features = _random_step(rng)
        noisy_ms = 1e3 * TRUE_COST(*features) * rng.gauss(1, 0.02)
        records.append(_record(step, *features, noisy_ms))
    fitted = fit_step_cost(records)
    # Decodes and requests move together here (as in a real trace), so their coefficients
    # trade off; the predictions are what must be right, on steps the fit has not seen.
    for _ in range(200):
        features = _random_step(rng)
        assert fitted(*features) == pytest.approx(TRUE_COST(*features), rel=0.03)
    assert fitted.per_prefill_token_s == pytest.approx(TRUE_COST.per_prefill_token_s, rel=0.1)
    assert fitted.per_pair_s == pytest.approx(TRUE_COST.per_pair_s, rel=0.1)


def test_the_fit_never_gives_a_negative_cost():
    # Steps whose time falls with their decode count: the free fit's decode cost is negative.
    records = [_record(i, 0, d, d * 100, d, 50.0 - d * 0.1) for i, d in enumerate(range(1, 65))]
    fitted = fit_step_cost(records)
    assert min(fitted.as_dict().values()) >= 0
    assert fitted(0, 32, 3200, 32) == pytest.approx(47e-3, rel=0.1)


def test_the_built_in_cost_is_the_fit_of_the_recorded_trace():
    trace = Path(__file__).parents[2] / BENCH_TRACE
    fitted, error = fit_trace_file(trace)
    for name, value in BENCH_MODEL_COST.as_dict().items():
        assert value == pytest.approx(getattr(fitted, name), rel=1e-3, abs=1e-12), name
    assert error < 0.2


def test_a_trace_without_attention_pairs_is_refused():
    records = [_record(i, 16, 4, 0, 5, 10.0) for i in range(20)]
    with pytest.raises(ValueError, match="attention pairs"):
        fit_step_cost(records)


def test_a_sessions_next_turn_resends_the_conversation_and_fits_the_context():
    config = WorkloadConfig(max_context_tokens=2048)
    for session in Workload(config).sessions(rate=2.0, duration_s=20.0):
        sent: list[int] = []
        while True:
            prompt = session.next_prompt()
            assert prompt[: len(sent)] == sent  # everything before, then the new message
            assert len(prompt) + session.max_tokens[session.turn] < config.max_context_tokens
            reply = list(range(session.max_tokens[session.turn]))
            sent = prompt + reply
            if not session.replied(reply):
                break


def test_a_simulated_engine_runs_a_request_in_the_steps_and_time_the_cost_model_gives():
    engine = SimEngine(
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=512),
        CacheConfig(block_size=16, enable_prefix_caching=True, num_blocks=64),
        TRUE_COST, vocab_size=100, seed=0,
    )  # fmt: skip
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    engine.add_request(Request(0, list(range(100)), params, max_model_len=512))
    durations, tokens = [], []
    while engine.has_work():
        scheduler_output, duration = engine.schedule()
        durations.append(duration)
        for outputs in engine.finish(scheduler_output).values():
            tokens += [t for o in outputs.outputs for t in o.new_token_ids]
    # 100 prompt tokens in chunks of 64 and 36 (the first token with the second), 4 decodes.
    assert len(tokens) == 5 and len(durations) == 6
    assert durations[0] == pytest.approx(TRUE_COST(64, 0, 64 * 65 // 2, 1))
    assert durations[1] == pytest.approx(TRUE_COST(36, 0, 36 * 64 + 36 * 37 // 2, 1))
    assert durations[2] == pytest.approx(TRUE_COST(0, 1, 101, 1))


def _small(policy: str, num_engines: int = 4, rate: float = 1.5) -> Simulation:
    workload = WorkloadConfig(num_system_prompts=8, turns=(3, 5), user_tokens=(32, 128),
                              output_tokens=(16, 48), think_time_s=0.5)  # fmt: skip
    config = SimConfig(num_engines, policy, rate, duration_s=30.0, num_blocks=512,
                       max_num_batched_tokens=256, workload=workload)  # fmt: skip
    return Simulation(config, TRUE_COST)


def test_prefix_affinity_keeps_conversations_on_their_engine_and_hits_the_cache_more():
    results = {policy: _small(policy).run() for policy in ("prefix-affinity", "least-loaded")}
    affinity, least = results["prefix-affinity"], results["least-loaded"]
    assert affinity.num_turns > 50 and affinity.num_without_first_token == 0
    assert affinity.prefix_hit_rate > 1.15 * least.prefix_hit_rate
    # The same sessions and arrivals either way: a run is a function of its configuration.
    assert _small("least-loaded").run() == least


def test_every_engine_serves_and_every_turn_ends():
    simulation = _small("least-loaded", num_engines=3)
    simulation.run()
    assert all(engine.num_steps > 0 for engine in simulation.engines)
    assert not simulation._turns  # nothing left in flight after the window's drain


def test_the_command_prints_both_tables(capsys):
    assert cli.main(["--engines", "1,2", "--duration-s", "12", "--margins", "4,16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {row["num_engines"] for row in report["scaling"]} == {1, 2}
    assert {row["policy"] for row in report["latency"]["rows"]} == {
        "prefix-affinity", "least-loaded", "round-robin"
    }  # fmt: skip
    assert report["one_engine_capacity_sessions_per_s"] > 0
    assert [row["margin"] for row in report["margin_sweep"]] == [4.0, 16.0]
