"""Async scheduling through the processes gives what the synchronous in-process engine gives.

Seeded sampling is the sharp check: a worker that sampled one token too many for a request, or
resumed a preempted request without the token that was in flight, would advance its generator
and change every later token; greedy decoding would hide that.
"""

from __future__ import annotations

import json

import pytest

from conveyor.frontend import LLM
from conveyor.protocol import SamplingParams

PROMPTS = [
    "The quick brown fox",
    "def main():",
    "Once upon a time, in a land far away",
    "import os\nimport sys\n",
    "Q: what is two plus two?\nA:",
]


def _kv_bytes(model_dir, num_blocks: int, block_size: int = 16) -> int:
    c = json.loads((model_dir / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per_block = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * block_size * 4
    return num_blocks * per_block


def _run(model_dir, engine: str, async_scheduling: bool, params, kv_cache_memory: int):
    with LLM(
        str(model_dir),
        engine=engine,
        async_scheduling=async_scheduling,
        kv_cache_memory=kv_cache_memory,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        seed=0,
    ) as llm:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        llm.check_all_free()
        results = [
            [(c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs]
            for o in outputs
        ]
        return results, llm.stats.num_preemptions


@pytest.mark.slow
@pytest.mark.parametrize("tiny_pool", [False, True], ids=["roomy", "tiny-pool"])
def test_async_scheduling_through_processes_matches_the_synchronous_engine(
    tiny_model_dir, tiny_pool
):
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(str(tiny_model_dir), engine="inprocess", kv_cache_memory=32 << 20) as llm:
        first = llm.generate(PROMPTS[0], greedy, use_tqdm=False)[0].outputs[0].token_ids
    params = [
        # Stops on its 6th greedy token: the run-ahead step after it must leave no trace.
        SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[first[5]], logprobs=2),
        SamplingParams(n=3, temperature=0.9, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=1, logprobs=1),
        SamplingParams(
            temperature=0.7, seed=5, max_tokens=24, repetition_penalty=1.3, min_tokens=4
        ),
        SamplingParams(n=2, temperature=1.2, min_p=0.05, seed=9, max_tokens=12),
    ]
    # Eight sequences of up to ~3 blocks each; 12 blocks make them preempt one another, also
    # while a token of theirs is in flight.
    memory = _kv_bytes(tiny_model_dir, 12) if tiny_pool else 32 << 20
    expected, _ = _run(tiny_model_dir, "inprocess", False, params, memory)
    assert expected[0][0][1] == "stop" and len(expected[0][0][0]) == 6
    got, num_preemptions = _run(tiny_model_dir, "mp", True, params, memory)
    assert got == expected
    assert (num_preemptions > 0) == tiny_pool


def test_the_engine_process_writes_its_step_trace(tiny_model_dir, tmp_path):
    from conveyor.engine_core.step_trace import read_trace

    trace = tmp_path / "steps.jsonl"
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(str(tiny_model_dir), kv_cache_memory=32 << 20, trace_steps=str(trace)) as llm:
        outputs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
        num_prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    records = read_trace(trace)  # complete once the engine has stopped
    assert sum(r.num_prefill_tokens for r in records) == num_prompt_tokens
    assert sum(r.num_decode_tokens for r in records) == 3 * (8 - 1)
