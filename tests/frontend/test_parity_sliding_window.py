"""Sliding-window attention against transformers, and the KV blocks it frees while requests run.

The generated Mistral windows every layer at 20 tokens (not a multiple of the 16-token block, so
window edges fall inside blocks); prompts run up to 60 tokens and outputs 32 more, so the last
tokens attend to a window four times shorter than their context. HF applies the same window in
its mask. Beyond the batch, chunked-prefill, prefix-cache and preemption runs of the other
families, the engine here must serve requests longer than its whole KV pool, which only freeing
the blocks behind the window allows, and keep the tokens through the multi-process engine.
"""

from __future__ import annotations

import pytest

from benchmarks.fixtures.model_maker import MISTRAL_SLIDING_WINDOW, ensure_model
from conveyor.frontend import LLM
from tests.frontend import test_parity_hf as common
from tests.frontend.test_parity_hf import (
    BLOCK_SIZE,
    GREEDY,
    MODEL_TEST_DTYPE,
    NUM_NEW_TOKENS,
    PROMPT_LENGTHS,
    SMALL_KV,
    Reference,
    _check,
    _llm,
    _reference,
)


@pytest.fixture(scope="module")
def reference(hf_model) -> Reference:
    reference = _reference(ensure_model("tiny", "mistral"), hf_model)
    assert reference.config["sliding_window"] == MISTRAL_SLIDING_WINDOW
    assert max(PROMPT_LENGTHS) + NUM_NEW_TOKENS >= 4 * MISTRAL_SLIDING_WINDOW
    return reference


def test_the_window_changes_hfs_tokens(reference, hf_model):
    """The parity below means something: without the window HF itself continues differently."""
    import copy

    import torch

    model = copy.deepcopy(hf_model(reference.model_dir))
    model.config.sliding_window = None
    longest = max(range(len(reference.prompts)), key=lambda i: len(reference.prompts[i]))
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([reference.prompts[longest]]),
            max_new_tokens=NUM_NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    unwindowed = out[0, len(reference.prompts[longest]) :].tolist()
    assert unwindowed != reference.tokens[longest]


def test_batch_chunked_prefill_matches_hf(reference):
    with _llm(reference, max_num_batched_tokens=16, max_num_seqs=8) as llm:
        outputs = llm.generate(reference.prompts, GREEDY, use_tqdm=False)
        _check(reference, outputs, list(range(len(reference.prompts))))
        llm.check_all_free()


def test_prefix_cache_hits_match_hf(reference):
    # Prompt 4's blocks are freed behind its window while it runs, but stay cached: both sharers
    # must still hit the two full blocks of the common prefix, as the dense families do.
    common.test_prefix_cache_hits_match_hf(reference)


def test_requests_longer_than_the_whole_pool_match_hf(reference):
    # Five usable blocks hold 80 tokens: the 92-token requests fit only because the blocks
    # behind their 20-token window go back to the pool (a request keeps at most the window
    # plus one 16-token chunk: 4 blocks). Without that the engine would have lowered
    # max_model_len to the pool and the frontend refused the longest requests.
    memory = 6 * reference.kv_bytes_per_block()
    with _llm(reference, kv_cache_memory=memory, max_num_batched_tokens=16, max_num_seqs=1) as llm:
        assert llm.config.scheduler.max_model_len > 6 * BLOCK_SIZE
        assert llm.config.cache.sliding_window == MISTRAL_SLIDING_WINDOW
        outputs = llm.generate(reference.prompts, GREEDY, use_tqdm=False)
        _check(reference, outputs, list(range(len(reference.prompts))))
        assert llm.stats.num_preemptions == 0
        llm.check_all_free()


def test_preemption_with_freed_blocks_matches_hf(reference):
    memory = 7 * reference.kv_bytes_per_block()
    with _llm(reference, kv_cache_memory=memory, max_num_batched_tokens=16, max_num_seqs=8) as llm:
        outputs = llm.generate(reference.prompts, GREEDY, use_tqdm=False)
        _check(reference, outputs, list(range(len(reference.prompts))))
        assert llm.stats.num_preemptions > 0
        llm.check_all_free()


@pytest.mark.slow
def test_the_multiprocess_engine_matches_hf(reference):
    with LLM(
        str(reference.model_dir),
        dtype=MODEL_TEST_DTYPE,
        block_size=BLOCK_SIZE,
        seed=0,
        kv_cache_memory=SMALL_KV,
        max_num_batched_tokens=16,
        async_scheduling=True,
    ) as llm:
        outputs = llm.generate(reference.prompts, GREEDY, use_tqdm=False)
        _check(reference, outputs, list(range(len(reference.prompts))))
