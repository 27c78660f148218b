"""--trace-steps: one record per executed step, with what the step held, in sync and async mode."""

from __future__ import annotations

from pathlib import Path

import pytest

import conveyor.entrypoints.cli
from conveyor.engine_core import EngineCore
from conveyor.engine_core.step_trace import read_trace
from conveyor.protocol import (
    CacheConfig,
    EngineConfig,
    EngineCoreRequest,
    ModelConfig,
    ObservabilityConfig,
    SamplingParams,
    SchedulerConfig,
)
from tests.fake_executor import FakeExecutor

VOCAB = 50


def make_engine(trace: Path, async_scheduling: bool) -> tuple[EngineCore, FakeExecutor]:
    config = EngineConfig(
        model=ModelConfig(model="fake", architecture="Fake", vocab_size=VOCAB, max_model_len=64),
        cache=CacheConfig(block_size=4, enable_prefix_caching=False),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=8, max_model_len=64, async_scheduling=async_scheduling
        ),
        observability=ObservabilityConfig(trace_steps=str(trace)),
    )
    executor = FakeExecutor(60, VOCAB, block_size=4)
    return EngineCore(config, executor), executor


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_one_record_per_executed_step_with_its_token_mix(tmp_path, async_scheduling):
    trace = tmp_path / "steps.jsonl"
    engine, executor = make_engine(trace, async_scheduling)
    prompts = [[1] * 13, [2] * 3, [3] * 6]
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=5, ignore_eos=True)
        engine.add_request(EngineCoreRequest(str(i), prompt, params, arrival_time=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    records = read_trace(trace)  # the engine is idle: flushed, no shutdown needed
    engine.shutdown()
    assert read_trace(trace) == records
    executed = executor.scheduler_outputs
    assert [r.step_id for r in records] == [s.step_id for s in executed]
    # Budget 8 chunks the 13-token prompt: steps mixing prompt chunks and decodes must show up.
    assert sum(r.num_prefill_tokens for r in records) == sum(len(p) for p in prompts)
    # Every output token but the last of each request is fed back as a decode token.
    assert sum(r.num_decode_tokens for r in records) == len(prompts) * (5 - 1)
    assert all(
        r.num_prefill_tokens + r.num_decode_tokens == s.total_num_scheduled_tokens
        for r, s in zip(records, executed)
    )
    assert any(r.num_prefill_tokens and r.num_decode_tokens for r in records)
    # Each request's n = prompt + 4 fed-back tokens sit at positions 0..n-1, and the token at
    # position p attends to p + 1 keys, however the steps chunked them.
    assert sum(r.num_attention_pairs for r in records) == sum(
        (len(p) + 4) * (len(p) + 5) // 2 for p in prompts
    )
    assert all(r.duration_ms >= 0 for r in records)
    assert [r.time for r in records] == sorted(r.time for r in records)
    assert records[-1].num_running == 0 and records[-1].kv_cache_usage == 0.0
    assert max(r.kv_cache_usage for r in records) > 0


def test_plot_trace_summarizes_and_draws(tmp_path, capsys):
    trace = tmp_path / "steps.jsonl"
    engine, _ = make_engine(trace, async_scheduling=False)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request(EngineCoreRequest("a", [5] * 10, params, arrival_time=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    engine.shutdown()
    out = tmp_path / "steps.png"
    assert conveyor.entrypoints.cli.main(["plot-trace", str(trace), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = capsys.readouterr().out
    assert "prefill_tokens: 10" in summary and "decode_tokens: 3" in summary
