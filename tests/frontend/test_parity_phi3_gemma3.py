"""Greedy parity with transformers for Phi-3, Gemma 3 and Gemma 2, through the engine.

The generated models window their attention: Phi-3 every layer (20 tokens), Gemma 3 and Gemma 2
two sliding layers (24 tokens) then a global one; Gemma 2 also caps its attention logits. The
checks are test_parity_hf.py's, run twice:

- Within the window, on a copy of each model whose window is out of reach of every prompt: the
  rest of each family (Phi-3's fused checkpoint tensors and partial rotary; Gemma's (1 + w)
  norms, scaled embedding, GeGLU, two RoPE tables and attention scale) through a batch of mixed
  lengths, chunked prefill, prefix-cache hits and preemption, whatever the attention backends do
  with windows.
- Past the window, on the models as generated: prompts and outputs up to 92 tokens, several
  windows long, which HF masks by the window and the backends must too.

Two more settings real checkpoints use get one batch each: LongRoPE with partial rotary (Phi-3.5,
Phi-4-mini) and a final logit softcap (Gemma 2's; null in Gemma 3).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks.fixtures.model_maker import MAX_POSITION_EMBEDDINGS, ensure_model, model_config
from tests.frontend import test_parity_hf as common
from tests.frontend.test_parity_hf import NUM_NEW_TOKENS, PROMPT_LENGTHS, Reference, _reference
from tests.worker.test_phi3_gemma3 import LONGROPE

FAMILIES = ("phi3", "gemma3", "gemma2")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def windowed(family, hf_model) -> Reference:
    reference = _reference(ensure_model("tiny", family), hf_model)
    window = model_config("tiny", family)["sliding_window"]
    assert max(PROMPT_LENGTHS) + NUM_NEW_TOKENS >= 3 * window and window % common.BLOCK_SIZE
    return reference


def _edited_copy(family: str, tmp_path_factory, **changes) -> Path:
    """The generated model with config.json changed; the window out of reach of every prompt."""
    model_dir: Path = tmp_path_factory.mktemp(family) / "model"
    shutil.copytree(ensure_model("tiny", family), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(sliding_window=MAX_POSITION_EMBEDDINGS, **changes)
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


@pytest.fixture(scope="module")
def unwindowed(family, hf_model, tmp_path_factory) -> Reference:
    return _reference(_edited_copy(family, tmp_path_factory), hf_model)


# ---------------------------------------------------------------- within the window


def test_batch_of_mixed_lengths_matches_hf(unwindowed):
    common.test_batch_of_mixed_lengths_matches_hf(unwindowed)


def test_chunked_prefill_matches_hf(unwindowed):
    common.test_chunked_prefill_matches_hf(unwindowed)


def test_prefix_cache_hits_match_hf(unwindowed):
    common.test_prefix_cache_hits_match_hf(unwindowed)


def test_preemption_under_a_tiny_kv_pool_matches_hf(unwindowed):
    common.test_preemption_under_a_tiny_kv_pool_matches_hf(unwindowed)


def test_longrope_with_partial_rotary_matches_hf_within_the_original_context(
    hf_model, tmp_path_factory
):
    model_dir = _edited_copy(
        "phi3", tmp_path_factory, rope_scaling=LONGROPE, max_position_embeddings=16384
    )
    common.test_batch_of_mixed_lengths_matches_hf(_reference(model_dir, hf_model))


def test_gemma2s_attention_softcap_changes_hfs_tokens(hf_model, tmp_path_factory):
    """Gemma 2's parity (every test here, family gemma2) means something for the cap on the
    attention logits: without it HF itself continues differently."""
    capped = _reference(_edited_copy("gemma2", tmp_path_factory), hf_model)
    uncapped = _reference(
        _edited_copy("gemma2", tmp_path_factory, attn_logit_softcapping=None), hf_model
    )
    assert capped.config["attn_logit_softcapping"] is not None
    assert capped.tokens != uncapped.tokens


def test_final_logit_softcapping_matches_hf(hf_model, tmp_path_factory):
    # A cap below the logits' spread (about 4) changes every logprob, not only the extremes.
    model_dir = _edited_copy("gemma3", tmp_path_factory, final_logit_softcapping=3.0)
    common.test_batch_of_mixed_lengths_matches_hf(_reference(model_dir, hf_model))


# ---------------------------------------------------------------- past the window


def test_the_window_changes_hfs_tokens(windowed, unwindowed):
    """The long-context parity below means something: without the window HF itself continues
    differently."""
    longest = max(range(len(PROMPT_LENGTHS)), key=lambda i: PROMPT_LENGTHS[i])
    assert windowed.prompts == unwindowed.prompts
    assert windowed.tokens[longest] != unwindowed.tokens[longest]


def test_long_contexts_with_chunked_prefill_match_hf(windowed):
    common.test_chunked_prefill_matches_hf(windowed)


def test_long_contexts_with_prefix_cache_hits_match_hf(windowed):
    common.test_prefix_cache_hits_match_hf(windowed)


def test_long_contexts_under_a_tiny_kv_pool_match_hf(windowed):
    common.test_preemption_under_a_tiny_kv_pool_matches_hf(windowed)


@pytest.mark.slow
def test_long_contexts_through_the_engine_and_worker_processes_match_hf(windowed):
    """The default engine (an engine-core process driving a worker process), async scheduling,
    chunked prefill and a pool that forces preemption, past the window."""
    from conveyor.frontend import LLM

    with LLM(
        str(windowed.model_dir),
        dtype=common.MODEL_TEST_DTYPE,
        kv_cache_memory=10 * windowed.kv_bytes_per_block(),
        block_size=common.BLOCK_SIZE,
        seed=0,
        max_num_batched_tokens=16,
        max_num_seqs=8,
        async_scheduling=True,
    ) as llm:
        outputs = llm.generate(windowed.prompts, common.GREEDY, use_tqdm=False)
        common._check(windowed, outputs, list(range(len(windowed.prompts))))
        assert llm.stats.num_preemptions > 0
