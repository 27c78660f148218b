"""Greedy parity with Hugging Face transformers for the mixture-of-experts families.

The machinery is test_parity_hf.py's (HF ``generate`` one prompt at a time as the reference;
identical tokens, logprobs within 1e-4, near ties reported), on the tiny Qwen3-MoE (a dense first
layer, then sparse ones) and Mixtral. Routing is per token, so a token's experts must not depend
on what else is in the batch: mixed lengths, chunked prefill, prefix-cache hits and preemption all
change the batch around the same tokens.
"""

from __future__ import annotations

import pytest

from conveyor.frontend import LLM
from tests.conftest import MOE_ARCHS
from tests.frontend import test_parity_hf as common
from tests.frontend.test_parity_hf import (
    BLOCK_SIZE,
    GREEDY,
    MODEL_TEST_DTYPE,
    SMALL_KV,
    Reference,
    _check,
    _reference,
)


@pytest.fixture(scope="module", params=MOE_ARCHS)
def reference(request, tiny_moe_model_dirs, hf_model) -> Reference:
    return _reference(tiny_moe_model_dirs[request.param], hf_model)


def _all(reference: Reference) -> list[int]:
    return list(range(len(reference.prompts)))


# The dense families' checks, on the MoE models.
def test_batch_of_mixed_lengths_matches_hf(reference):
    common.test_batch_of_mixed_lengths_matches_hf(reference)


def test_chunked_prefill_matches_hf(reference):
    common.test_chunked_prefill_matches_hf(reference)


def test_prefix_cache_hits_match_hf(reference):
    common.test_prefix_cache_hits_match_hf(reference)


def test_preemption_under_a_tiny_kv_pool_matches_hf(reference):
    common.test_preemption_under_a_tiny_kv_pool_matches_hf(reference)


def test_engine_and_worker_processes_match_hf(tiny_moe_model_dirs, hf_model):
    """The default engine: an engine-core process driving a worker process, chunked prefill."""
    reference = _reference(tiny_moe_model_dirs["mixtral"], hf_model)
    with LLM(
        str(reference.model_dir),
        dtype=MODEL_TEST_DTYPE,
        kv_cache_memory=SMALL_KV,
        block_size=BLOCK_SIZE,
        seed=0,
        max_num_batched_tokens=32,
        max_num_seqs=8,
    ) as llm:
        outputs = llm.generate(reference.prompts, GREEDY, use_tqdm=False)
        _check(reference, outputs, _all(reference))
