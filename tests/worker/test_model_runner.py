"""The model runner on the tiny model, driven by hand-made SchedulerOutputs (no engine core)."""

from __future__ import annotations

import pytest
import torch

from conveyor.frontend.engine_args import EngineArgs
from conveyor.protocol import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from conveyor.protocol.config import ConfigError
from conveyor.worker.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0)
BLOCK_SIZE = 16
PROMPT = [5, 17, 99, 240, 3, 77, 1023, 64, 12, 9, 300, 45, 8, 600, 31, 7, 250, 19, 88, 140]


@pytest.fixture(scope="module")
def config(tiny_model_dir):
    args = EngineArgs(
        model=str(tiny_model_dir),
        max_num_seqs=4,
        max_model_len=256,
        block_size=BLOCK_SIZE,
        kv_cache_memory=4 << 20,
        device="cpu",
    )
    return args.create_engine_config()


@pytest.fixture
def runner(config) -> ModelRunner:
    runner = ModelRunner(config, torch.device("cpu"))
    runner.initialize_cache(64)
    return runner


def _new(req_id, prompt, blocks, scheduled, params=GREEDY, computed=0):
    return NewRequestData(req_id, prompt, params, blocks, computed, scheduled)


def _cached(entries, resumed=None):
    return CachedRequestData(
        req_ids=[e[0] for e in entries],
        new_block_ids=[e[1] for e in entries],
        num_computed_tokens=[e[2] for e in entries],
        num_scheduled_tokens=[e[3] for e in entries],
        resumed_token_ids=resumed or {},
    )


def _decode(runner, step, entries, **kwargs):
    out = runner.execute_model(
        SchedulerOutput(step, scheduled_cached_reqs=_cached(entries), **kwargs)
    )
    return dict(zip(out.req_ids, out.sampled_token_ids))


def _greedy_alone(config, prompt, num_tokens, params=GREEDY) -> list[int]:
    runner = ModelRunner(config, torch.device("cpu"))
    runner.initialize_cache(16)
    out = runner.execute_model(
        SchedulerOutput(1, [_new(0, prompt, [1, 2, 3], len(prompt), params)])
    )
    tokens = list(out.sampled_token_ids)
    for step in range(2, num_tokens + 1):
        num_computed = len(prompt) + len(tokens) - 1
        tokens.append(_decode(runner, step, [(0, [], num_computed, 1)])[0])
    return tokens


def test_cpu_kv_budget_sets_the_number_of_blocks(runner, config):
    assert runner.determine_num_blocks() == config.cache.kv_cache_memory // runner.bytes_per_block()


def test_an_unset_cpu_kv_budget_is_one_gib(tiny_model_dir):
    # None in the config (so CUDA can tell "unset" from a size it must honour); 1 GiB on CPU.
    args = EngineArgs(model=str(tiny_model_dir), max_model_len=256, device="cpu")
    config = args.create_engine_config()
    assert config.cache.kv_cache_memory is None
    runner = ModelRunner(config, torch.device("cpu"))
    assert runner.determine_num_blocks() == (1 << 30) // runner.bytes_per_block()


def test_a_cpu_runner_refuses_a_gpu_memory_share(tiny_model_dir):
    # Nothing on CPU reads it: set, it is refused at start rather than silently ignored.
    args = EngineArgs(model=str(tiny_model_dir), max_model_len=256, gpu_memory_utilization=0.5)
    with pytest.raises(ConfigError, match="applies to CUDA devices, this engine runs on cpu"):
        ModelRunner(args.create_engine_config(), torch.device("cpu"))


def test_chunked_prefill_samples_only_when_the_prompt_is_complete(runner, config):
    expected = _greedy_alone(config, PROMPT, 4)
    first = runner.execute_model(SchedulerOutput(1, [_new(0, PROMPT, [1], 8)]))
    assert first.req_ids == [] and first.sampled_token_ids == []
    second = _decode(runner, 2, [(0, [2], 8, 7)])
    assert second == {}
    tokens = [_decode(runner, 3, [(0, [], 15, 5)])[0]]
    for step in range(4, 7):
        tokens.append(_decode(runner, step, [(0, [], len(PROMPT) + len(tokens) - 1, 1)])[0])
    assert tokens == expected


def test_batch_rows_match_each_request_alone_and_survive_condensing(runner, config):
    prompts = {0: PROMPT[:5], 1: PROMPT, 2: PROMPT[3:14]}
    expected = {r: _greedy_alone(config, p, 6) for r, p in prompts.items()}
    blocks = {0: [1, 2], 1: [3, 4], 2: [5, 6]}
    new = [_new(r, p, blocks[r], len(p)) for r, p in prompts.items()]
    out = runner.execute_model(SchedulerOutput(1, new))
    assert sorted(out.req_ids) == [0, 1, 2]
    got = {r: [t] for r, t in zip(out.req_ids, out.sampled_token_ids)}
    for step in range(2, 7):
        # Request 0 finishes after its third token: its row is refilled from the tail.
        alive = [r for r in got if not (r == 0 and len(got[0]) == 3)]
        finished = [0] if 0 not in alive and 0 in runner.batch.row_of else []
        entries = [(r, [], len(prompts[r]) + len(got[r]) - 1, 1) for r in alive]
        sampled = _decode(runner, step, entries, finished_req_ids=finished)
        assert set(sampled) == set(alive)
        for r, t in sampled.items():
            got[r].append(t)
    assert got[1] == expected[1] and got[2] == expected[2] and got[0] == expected[0][:3]
    assert 0 not in runner.batch.states


def test_preempted_request_resumes_with_its_seeded_generator(runner, config):
    seeded = SamplingParams(temperature=1.0, seed=42)
    expected = _greedy_alone(config, PROMPT, 6, seeded)
    out = runner.execute_model(SchedulerOutput(1, [_new(0, PROMPT, [1, 2], 20, seeded)]))
    tokens = list(out.sampled_token_ids)
    tokens.append(_decode(runner, 2, [(0, [], 20, 1)])[0])
    runner.execute_model(SchedulerOutput(3, preempted_req_ids=[0]))
    assert runner.batch.num_reqs == 0
    # Resumed on different blocks: the whole history is recomputed, then sampling goes on.
    history = PROMPT + tokens
    resumed = _cached([(0, [7, 8], 0, len(history))], resumed={0: history})
    out = runner.execute_model(SchedulerOutput(4, scheduled_cached_reqs=resumed))
    tokens.extend(out.sampled_token_ids)
    for step in range(5, 8):
        tokens.append(_decode(runner, step, [(0, [], len(PROMPT) + len(tokens) - 1, 1)])[0])
    assert tokens == expected


def test_logprobs_rows_align_with_sampled_tokens(runner):
    wants = SamplingParams(temperature=0.0, logprobs=2)
    new = [_new(0, PROMPT[:6], [1], 6, wants), _new(1, PROMPT[:9], [2], 9, GREEDY)]
    out = runner.execute_model(SchedulerOutput(1, new))
    rows = dict(zip(out.req_ids, range(2)))
    lp = out.logprobs
    assert lp is not None and len(lp.token_ids) == 2
    row = rows[0]
    assert lp.token_ids[row][0] == out.sampled_token_ids[row] and len(lp.token_ids[row]) == 3
    assert lp.ranks[row] == 1  # greedy picks the top token
    assert lp.token_ids[rows[1]] == [] and lp.ranks[rows[1]] == 0


def test_worst_case_profiling_step_runs_and_releases_its_cache(config):
    from conveyor.worker.memory_profile import _dummy_lengths, run_worst_case_step

    lengths = _dummy_lengths(2048, 4, 256)
    assert lengths.sum() == 2048 and lengths.max() <= 256 and len(lengths) == 8
    runner = ModelRunner(config, torch.device("cpu"))
    run_worst_case_step(runner)
    assert all(layer.kv_cache is None for layer in runner.attention_layers)
    # The real cache binds afterwards and the runner works as usual.
    runner.initialize_cache(16)
    out = runner.execute_model(SchedulerOutput(1, [_new(0, PROMPT, [1, 2], len(PROMPT))]))
    assert out.req_ids == [0]
