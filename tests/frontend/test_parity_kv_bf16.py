"""``--kv-cache-dtype bfloat16`` on float32 models against transformers with the same cache.

transformers runs the float32 model with a cache that rounds every key and value to bfloat16 as
it stores them (and attends to what it stored, the step's own keys included), which is what the
engine's bfloat16 cache holds; everything else stays float32 in both. The tokens must be the same
and the logprobs close (ROUNDING_TOLERANCE, most first tokens within float32 parity's 1e-4),
through the compiled kernel and through the torch path, with chunked prefill and prefix-cache
hits. A near tie is reported by name, as in test_parity_hf.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conveyor.frontend import LLM
from tests.frontend.test_parity_hf import (
    ARCHS,
    BLOCK_SIZE,
    GREEDY,
    Reference,
    _check,
    _reference,
)
from tests.frontend.test_parity_hf import _llm as parity_llm


class Bfloat16Cache(DynamicCache):
    """transformers' dynamic cache, keeping each key and value as bfloat16 would (in float32)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        def rounded(t: torch.Tensor) -> torch.Tensor:
            return t.to(torch.bfloat16).to(t.dtype)

        return super().update(
            rounded(key_states), rounded(value_states), layer_idx, *args, **kwargs
        )


_REFERENCES: dict = {}
# Looser than float32 parity's 1e-4, and so are near ties: the engine's attention differs from
# transformers' by float32 noise (~1e-7), which moves the next layer's keys and values by as
# much; one that lies that close to a bfloat16 rounding boundary rounds the other way, and then
# differs by a whole bfloat16 step (2^-8 of it). On the tiny models one such element moved a
# first token's logprob by 3e-3 (Llama, prompt 2, the kernel path); the others were within
# 3e-5. So: every logprob within ROUNDING_TOLERANCE, and most first tokens within float32
# parity's tolerance (FLOAT_EXACT), which the float32 model's are far from (0.03-0.7: the test
# below).
ROUNDING_TOLERANCE = 1e-2
ROUNDING_TIE_GAP = 2e-2
FLOAT_EXACT = 1e-4


@pytest.fixture(scope="module", params=ARCHS)
def bf16_cache_reference(request, tiny_model_dirs, hf_model) -> Reference:
    model_dir = tiny_model_dirs[request.param]
    if model_dir not in _REFERENCES:
        _REFERENCES[model_dir] = Reference(model_dir, hf_model(model_dir), Bfloat16Cache)
    return _REFERENCES[model_dir]


def first_token_deviations(reference: Reference, outputs, indices: list[int]) -> list[float]:
    """|our logprob - HF's| of each output's first token (its context: the prompt alone)."""
    deviations = []
    for i, output in zip(indices, outputs):
        completion = output.outputs[0]
        token = completion.token_ids[0]
        expected = torch.log_softmax(reference.logits[i][0], dim=-1)[token].item()
        deviations.append(abs(completion.logprobs[0][token] - expected))
    return deviations


def _llm(reference: Reference, **engine_args) -> LLM:
    # On the CPU in float32 in a CUDA test run too: a float32 model's bfloat16 cache is CPU only.
    return parity_llm(
        reference, dtype="float32", device="cpu", kv_cache_dtype="bfloat16", **engine_args
    )


@pytest.mark.parametrize("attention_backend", ["auto", "torch"])
def test_chunked_prefill_and_prefix_hits_match_hf_with_the_same_cache(
    bf16_cache_reference, attention_backend
):
    reference = bf16_cache_reference
    with _llm(
        reference, attention_backend=attention_backend, max_num_batched_tokens=16, max_num_seqs=8
    ) as llm:
        everything = list(range(len(reference.prompts)))
        outputs = llm.generate(reference.prompts, GREEDY, use_tqdm=False)
        _check(reference, outputs, everything, ROUNDING_TOLERANCE, ROUNDING_TIE_GAP)
        deviations = first_token_deviations(reference, outputs, everything)
        exact = sum(d < FLOAT_EXACT for d in deviations)
        assert exact >= 0.75 * len(deviations), deviations
        # Again: these prompts now start on their own cached, rounded blocks.
        again = llm.generate([reference.prompts[i] for i in (5, 6)], GREEDY, use_tqdm=False)
        _check(reference, again, [5, 6], ROUNDING_TOLERANCE, ROUNDING_TIE_GAP)
        full_blocks = [len(reference.prompts[i]) // BLOCK_SIZE * BLOCK_SIZE for i in (5, 6)]
        assert [o.num_cached_tokens for o in again] == full_blocks
        llm.check_all_free()


def test_the_bfloat16_cache_reference_is_not_the_float32_model(bf16_cache_reference, hf_model):
    # Rounding the cache moves the first logits by 0.03-0.7 on these prompts, far more than
    # FLOAT_EXACT: the test above passing means the engine's cache held bfloat16 values.
    reference = bf16_cache_reference
    float_reference = _reference(reference.model_dir, hf_model)
    # At the first sampled position both have the same context, the prompt.
    gaps = [
        (ours[0] - theirs[0]).abs().max().item()
        for ours, theirs in zip(reference.logits, float_reference.logits)
    ]
    assert min(gaps) > 100 * FLOAT_EXACT, gaps
