"""Speculative decoding (ngram and draft_model) through the processes: greedy outputs are those
without it.

The embedded default model copies text it has seen, so n-gram drafts are often right and often
wrong: both the accepted and the rejected paths run. As a draft model it drafts for itself
(its drafts nearly all accepted: a draft KV that fell out of step would show as rejections);
the random-weight "small" model of the same vocabulary drafts nearly all wrong. The engines run with async scheduling,
prompt chunks of 32 tokens, a KV pool small enough to preempt, and repeated prompts (prefix-cache
hits); the requests cover stop strings, stop tokens, logprobs, min_tokens, penalties, n > 1 and
a structured output (its drafts checked by its grammar).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.fixtures.model_maker import ensure_model
from conveyor.frontend import LLM
from conveyor.frontend.engine_args import DEFAULT_MODEL_DIR, EngineArgs
from conveyor.protocol import SamplingParams, StructuredOutputsParams
from conveyor.protocol.config import ConfigError

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
    "disable_by_batch_size": 16,
}
SOURCE = (DEFAULT_MODEL_DIR.parent / "output_processor.py").read_text()


def _copy_prompt(start: int, size: int, repeat: int) -> str:
    text = SOURCE[start : start + size]
    return text + "\n" + text[:repeat]


PROMPTS = [
    _copy_prompt(0, 600, 120),
    _copy_prompt(2000, 500, 80),
    _copy_prompt(0, 600, 120),  # the first again: prefix-cache hits
    "def main():\n    return main()\n\ndef main():\n",
    _copy_prompt(4000, 700, 150),
    _copy_prompt(6000, 400, 60),
    _copy_prompt(600, 300, 100),
]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=40, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=40, stop=["return", "\n\n\n"]),
    SamplingParams(temperature=0.0, max_tokens=33, n=2),
    SamplingParams(temperature=0.0, max_tokens=40, min_tokens=20, stop_token_ids=[198, 220]),
    SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.2),
    SamplingParams(temperature=0.0, max_tokens=5),
    # Structured: drafts cut at the first token the grammar refuses, every position masked.
    SamplingParams(
        temperature=0.0,
        max_tokens=24,
        structured_outputs=StructuredOutputsParams(regex="[a-z_ .()]{4,40}"),
    ),
]


def _kv_bytes(num_blocks: int, model_dir=DEFAULT_MODEL_DIR, block_size: int = 16) -> int:
    c = json.loads((model_dir / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per_block = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * block_size * 4
    return num_blocks * per_block


def _run(num_blocks: int = 40, **engine_args) -> tuple[list, object]:
    memory = _kv_bytes(num_blocks)
    spec = engine_args.get("speculative_config") or {}
    if "model" in spec:  # a draft model's KV shares each block
        memory += _kv_bytes(num_blocks, Path(spec["model"]))
    with LLM(
        async_scheduling=True,
        kv_cache_memory=memory,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        **engine_args,
    ) as llm:
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        llm.check_all_free()
        results = [
            [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs]
            for o in outputs
        ]
        return results, llm.stats


@pytest.fixture(scope="module")
def runs() -> tuple:
    return _run(), _run(speculative_config=SPEC)


@pytest.mark.slow
def test_greedy_outputs_with_ngram_equal_those_without(runs) -> None:
    (plain, _), (spec, _) = runs
    for i, (a, b) in enumerate(zip(plain, spec)):
        for choice_a, choice_b in zip(a, b):
            tokens_a, text_a, *rest_a = choice_a
            tokens_b, text_b, *rest_b = choice_b
            assert tokens_b == tokens_a, f"prompt {i}"
            assert text_b == text_a, f"prompt {i}"
            assert rest_b[:2] == rest_a[:2], f"prompt {i}"
            logprobs_a, logprobs_b = rest_a[2], rest_b[2]
            if logprobs_a is not None:
                assert len(logprobs_b) == len(logprobs_a)
                for row_a, row_b in zip(logprobs_a, logprobs_b):
                    assert row_b.keys() == row_a.keys()
                    for token in row_a:
                        assert row_b[token] == pytest.approx(row_a[token], abs=1e-4)


@pytest.mark.slow
def test_both_paths_ran(runs) -> None:
    """Drafts were accepted and rejected, requests were preempted and prompts chunked: the
    equality above covered what it claims to."""
    (_, plain_stats), (_, stats) = runs
    assert stats.spec_num_drafts > 0
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    # Rejected drafts are not generated tokens.
    assert stats.num_generation_tokens <= plain_stats.num_generation_tokens + 4 * 8


@pytest.mark.slow
def test_two_tensor_parallel_ranks_give_the_same_greedy_outputs(runs) -> None:
    """Every rank verifies the drafts on its own (same logits, same tokens) and proposes from
    its own mirror: rank 1's mirror going astray would change its KV and then the tokens."""
    (plain, _), _ = runs
    spec, stats = _run(speculative_config=SPEC, tensor_parallel_size=2)
    assert stats.spec_num_accepted_tokens > 0
    for i, (a, b) in enumerate(zip(plain, spec)):
        assert [c[:4] for c in b] == [c[:4] for c in a], f"prompt {i}"


def _seeded_twice(spec: dict, kv_cache_memory: int) -> tuple[list[list[int]], object]:
    """Two engines given the same seeded requests (an unseeded one runs beside): the seeded
    rows' sampled tokens, checked equal in both, and the first engine's stats."""
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, max_tokens=30, seed=11, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=30, seed=12, n=2, ignore_eos=True),
        SamplingParams(temperature=0.7, max_tokens=30),
    ]
    runs = []
    for _ in range(2):
        with LLM(kv_cache_memory=kv_cache_memory, speculative_config=spec) as llm:
            outputs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
            llm.check_all_free()
            runs.append(([c.token_ids for o in outputs[:2] for c in o.outputs], llm.stats))
    (first, stats), (second, _) = runs
    assert first == second
    assert len(first) == 3 and all(len(tokens) == 30 for tokens in first)
    return first, stats


@pytest.mark.slow
def test_seeded_sampling_with_drafts_repeats_through_the_processes() -> None:
    """Seeded rows draw every acceptance test and resample from their own generator: two
    engines given the same requests give the same sampled tokens (unseeded rows run beside)."""
    _, stats = _seeded_twice(SPEC, _kv_bytes(200))
    assert stats.spec_num_accepted_tokens > 0


def _draft(model: object, **keys: object) -> dict:
    return {"model": str(model), "num_speculative_tokens": 3, "disable_by_batch_size": 16, **keys}


@pytest.fixture(scope="module")
def draft_runs() -> tuple:
    """The default model drafting for itself, and a random model of its vocabulary."""
    other = ensure_model("small", "qwen3")
    return (
        _run(speculative_config=_draft(DEFAULT_MODEL_DIR)),
        _run(speculative_config=_draft(other)),
    )


def _assert_same_outputs(plain: list, spec: list) -> None:
    for i, (a, b) in enumerate(zip(plain, spec)):
        for choice_a, choice_b in zip(a, b):
            assert choice_b[:4] == choice_a[:4], f"prompt {i}"
            logprobs_a, logprobs_b = choice_a[4], choice_b[4]
            if logprobs_a is not None:
                assert [row.keys() for row in logprobs_b] == [row.keys() for row in logprobs_a]
                for row_a, row_b in zip(logprobs_a, logprobs_b):
                    for token in row_a:
                        assert row_b[token] == pytest.approx(row_a[token], abs=1e-4)


@pytest.mark.slow
def test_greedy_outputs_with_a_draft_model_equal_those_without(runs, draft_runs) -> None:
    (plain, _), _ = runs
    for spec, _ in draft_runs:
        _assert_same_outputs(plain, spec)


@pytest.mark.slow
def test_draft_models_ran_both_paths_under_preemption_and_prefix_hits(draft_runs) -> None:
    (_, own), (_, other) = draft_runs
    for stats in (own, other):
        assert stats.spec_num_drafts > 0
        assert stats.num_preemptions > 0
        assert stats.prefix_cache_hits > 0
    # Its own drafts are the target's argmax wherever the request has no penalty, grammar or
    # min_tokens ban to differ by: most are accepted, some are not.
    assert 0.6 * own.spec_num_draft_tokens < own.spec_num_accepted_tokens
    assert own.spec_num_accepted_tokens < own.spec_num_draft_tokens
    # A random model's drafts: nearly all rejected (and the back-off thins them).
    assert other.spec_num_accepted_tokens < 0.2 * other.spec_num_draft_tokens


@pytest.mark.slow
def test_a_draft_model_over_two_tensor_parallel_ranks_gives_the_same_greedy_outputs(runs) -> None:
    """Target and draft both sharded over two ranks; each rank's draft makes the same drafts
    and keeps the same KV, or the ranks' tokens would part."""
    (plain, _), _ = runs
    spec, stats = _run(speculative_config=_draft(DEFAULT_MODEL_DIR), tensor_parallel_size=2)
    assert stats.spec_num_accepted_tokens > 0
    for i, (a, b) in enumerate(zip(plain, spec)):
        assert [c[:4] for c in b] == [c[:4] for c in a], f"prompt {i}"


@pytest.mark.slow
def test_seeded_sampling_with_an_int4_draft_model_repeats_through_the_processes() -> None:
    """Sampled requests verify against the draft's q (the target's int4 copy: close, not equal,
    so most drafts pass min(1, p/q) and some do not); seeded ones draw drafts and tests from
    their own generator, so they repeat."""
    # The target's blocks and its int4 copy's.
    _, stats = _seeded_twice(_draft(DEFAULT_MODEL_DIR, quantization="int4"), 2 * _kv_bytes(200))
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


def test_a_draft_model_of_another_vocabulary_is_refused_at_start_up() -> None:
    tiny = ensure_model("tiny", "qwen3")  # 2048 tokens; the default model has 4096
    args = EngineArgs(speculative_config=_draft(tiny))
    with pytest.raises(ConfigError, match="vocabulary of 2048 tokens.*has 4096") as error:
        args.create_engine_config()
    assert str(tiny) in str(error.value) and str(DEFAULT_MODEL_DIR) in str(error.value)
    for keys, word in [
        ({"quantization": "gptq"}, "not quantized"),
        ({"quantization": "int3"}, "quantization must be one of"),
    ]:
        with pytest.raises(ConfigError, match=word):
            EngineArgs(speculative_config=_draft(DEFAULT_MODEL_DIR, **keys)).create_engine_config()
    with pytest.raises(ConfigError, match="runs on CPU only"):
        EngineArgs(
            device="cuda", speculative_config=_draft(DEFAULT_MODEL_DIR, quantization="int4")
        ).create_engine_config()
