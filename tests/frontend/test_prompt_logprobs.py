"""Prompt logprobs (``SamplingParams(prompt_logprobs=k)``) against transformers on the same
weights: every prompt token's log-probability given the ones before it, and its top-k rivals,
with prompts cut into chunks, prompts that share a cached prefix, a preemption, async
scheduling and worker processes.

The reference is one forward pass of the whole prompt through ``AutoModelForCausalLM`` in
float32; values must agree within 1e-4. A top-k set is compared where the k-th and (k+1)-th
values are apart by more than float error: at a near tie either order is right, and the test
says which position it let pass (``NearTieWarning``) rather than skipping it silently.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from conveyor import LLM, SamplingParams
from tests.devices import MODEL_TEST_DTYPE, logprob_tolerance

TOLERANCE = logprob_tolerance(MODEL_TEST_DTYPE)
TOP_K = 3
TIE_GAP = 1e-4
# A chunk budget smaller than most prompts: each is prefilled over several steps.
CHUNK = 32
LENGTHS = (1, 2, 17, 45, 70, 96)


class NearTieWarning(UserWarning):
    """A top-k set differs from transformers' only where two candidates (nearly) tie."""


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: Path) -> list[list[int]]:
    import json

    vocab_size = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, vocab_size, n).tolist() for n in LENGTHS]
    prompts[5][:64] = prompts[4][:64]  # four full blocks of a cached prefix
    return prompts


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' log_softmax at every prompt position, per prompt (float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1) for p in prompts]


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Iterator[LLM]:
    setup = {"kv_cache_memory": 16 << 20, "max_num_batched_tokens": CHUNK}
    with LLM(str(tiny_model_dir), engine="inprocess", **setup) as llm:
        yield llm


def _check(prompt: list[int], got, expected: torch.Tensor, name: str) -> None:
    """``got`` (a RequestOutput's prompt_logprobs) against transformers' rows."""
    assert got is not None and len(got) == len(prompt) and got[0] is None, name
    for position, row in enumerate(got[1:]):
        token, logprobs = prompt[position + 1], expected[position]
        assert abs(row[token] - logprobs[token].item()) <= TOLERANCE, (name, position)
        for t, v in row.items():  # the token itself, then its top-k rivals
            assert abs(v - logprobs[t].item()) <= TOLERANCE, (name, position, t)
        top = logprobs.topk(TOP_K + 1)
        wanted = set(top.indices[:TOP_K].tolist())
        if not wanted <= set(row) and top.values[TOP_K - 1] - top.values[TOP_K] > TIE_GAP:
            raise AssertionError(f"{name} position {position}: top-{TOP_K} {wanted} vs {row}")
        if not wanted <= set(row):
            message = f"{name} position {position}: near tie in the top-{TOP_K}"
            warnings.warn(message, NearTieWarning, stacklevel=2)


def test_prompt_logprobs_equal_transformers_with_chunked_prompts(llm, prompts, reference):
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP_K)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        _check(prompt, output.prompt_logprobs, reference[i], f"prompt {i}")
        assert len(output.outputs[0].token_ids) == 2
    plain = llm.generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)
    assert plain[0].prompt_logprobs is None
    llm.check_all_free()


def test_max_tokens_0_scores_the_prompt_and_generates_nothing(llm, prompts, reference):
    params = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=TOP_K)
    outputs = llm.generate(prompts[2:4], params, use_tqdm=False)
    for i, output in enumerate(outputs, 2):
        (choice,) = output.outputs
        assert (choice.token_ids, choice.text, choice.finish_reason) == ([], "", "length")
        _check(prompts[i], output.prompt_logprobs, reference[i], f"prompt {i}, max_tokens 0")
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        SamplingParams(max_tokens=0)
    llm.check_all_free()


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(llm, prompts, reference):
    """Prompt 5 shares four blocks with prompt 4, cached by a plain request first: a request for
    prompt logprobs reads no hit (those positions need their forward pass), others still do."""
    llm.generate([prompts[4]], SamplingParams(max_tokens=1), use_tqdm=False)
    hit = llm.generate([prompts[5]], SamplingParams(max_tokens=1), use_tqdm=False)
    assert hit[0].num_cached_tokens >= 64
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=TOP_K)
    (output,) = llm.generate([prompts[5]], params, use_tqdm=False)
    assert output.num_cached_tokens == 0
    _check(prompts[5], output.prompt_logprobs, reference[5], "prompt 5 after its prefix")


@pytest.mark.slow
def test_worker_processes_async_scheduling_and_a_preemption_give_the_same_rows(
    tiny_model_dir, prompts, reference
):
    """Through worker processes with async scheduling, and with a KV pool so small that the
    longest prompts preempt each other mid-prompt (rows already recorded are not repeated)."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=TOP_K)
    setups = [
        {"async_scheduling": True, "kv_cache_memory": 16 << 20},
        {"engine": "inprocess", "kv_cache_memory": 8 * 16 * 512, "max_model_len": 128},
    ]
    for setup in setups:
        with LLM(str(tiny_model_dir), max_num_batched_tokens=CHUNK, **setup) as llm:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            stats = llm.stats
        for i, (prompt, output) in enumerate(zip(prompts, outputs)):
            _check(prompt, output.prompt_logprobs, reference[i], f"{setup} prompt {i}")
        if "max_model_len" in setup:
            assert stats is not None and stats.num_preemptions > 0, "no preemption happened"
