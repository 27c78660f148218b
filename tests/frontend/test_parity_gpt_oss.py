"""gpt-oss against transformers: attention sinks, alternating windowed and global layers, a
router with a bias picking experts stored in MXFP4.

The generated model is what a released checkpoint looks like (MXFP4 ``*_blocks``/``*_scales``
experts and ``quantization_config``), which transformers unpacks on load (it needs accelerate)
and we unpack ourselves. Its sliding layers see 20 tokens; prompts and outputs reach 92. The
checks that the sinks and the window change HF's own tokens keep the parity meaningful.
"""

from __future__ import annotations

import copy

import pytest
import torch

from benchmarks.fixtures.model_maker import GPT_OSS_SLIDING_WINDOW, ensure_model
from conveyor.frontend import LLM
from tests.frontend import test_parity_hf as common
from tests.frontend.test_parity_hf import (
    BLOCK_SIZE,
    GREEDY,
    MODEL_TEST_DTYPE,
    NUM_NEW_TOKENS,
    SMALL_KV,
    Reference,
    _check,
    _llm,
    _reference,
)


@pytest.fixture(scope="module")
def reference(hf_model) -> Reference:
    reference = _reference(ensure_model("tiny", "gpt_oss"), hf_model)
    assert reference.config["quantization_config"]["quant_method"] == "mxfp4"
    return reference


def _hf_tokens(model, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NUM_NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def test_the_sinks_and_the_window_change_hfs_tokens(reference, hf_model):
    model = hf_model(reference.model_dir)
    longest = max(range(len(reference.prompts)), key=lambda i: len(reference.prompts[i]))
    prompt = reference.prompts[longest]
    assert len(prompt) + NUM_NEW_TOKENS > 4 * GPT_OSS_SLIDING_WINDOW
    unwindowed = copy.deepcopy(model)
    for layer in unwindowed.model.layers:
        layer.self_attn.sliding_window = None
    unwindowed.config.layer_types = ["full_attention"] * len(unwindowed.model.layers)
    assert _hf_tokens(unwindowed, prompt) != reference.tokens[longest]
    sinkless = copy.deepcopy(model)
    for layer in sinkless.model.layers:
        layer.self_attn.sinks.data.fill_(-1e4)  # exp(-1e4) = 0: as if there were no sink
    assert _hf_tokens(sinkless, prompt) != reference.tokens[longest]


def test_batch_and_chunked_prefill_match_hf(reference):
    with _llm(reference, max_num_batched_tokens=16, max_num_seqs=8) as llm:
        outputs = llm.generate(reference.prompts, GREEDY, use_tqdm=False)
        _check(reference, outputs, list(range(len(reference.prompts))))
        # Global layers keep every block: nothing may be freed behind the sliding ones.
        assert llm.config.cache.sliding_window is None
        llm.check_all_free()


def test_prefix_cache_hits_match_hf(reference):
    common.test_prefix_cache_hits_match_hf(reference)


def test_preemption_under_a_tiny_kv_pool_matches_hf(reference):
    common.test_preemption_under_a_tiny_kv_pool_matches_hf(reference)


@pytest.mark.slow
def test_two_ranks_through_the_multiprocess_engine_match_hf(reference):
    # Tensor parallelism splits the heads (and their sinks) and every expert's intermediate
    # dimension; the biases of o_proj and of the experts' down projections are added once.
    with LLM(
        str(reference.model_dir),
        dtype=MODEL_TEST_DTYPE,
        block_size=BLOCK_SIZE,
        seed=0,
        kv_cache_memory=SMALL_KV,
        max_num_batched_tokens=16,
        tensor_parallel_size=2,
    ) as llm:
        outputs = llm.generate(reference.prompts, GREEDY, use_tqdm=False)
        _check(reference, outputs, list(range(len(reference.prompts))))


def test_the_configs_swiglu_alpha_and_limit_are_honoured(reference, hf_model, tmp_path):
    """Not gpt-oss's released values (1.702, 7): a model that ignored either would differ."""
    import json
    import shutil

    model_dir = tmp_path / "gpt-oss-swiglu"
    shutil.copytree(reference.model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(swiglu_alpha=1.0, swiglu_limit=2.0)
    (model_dir / "config.json").write_text(json.dumps(config))
    changed = _reference(model_dir, hf_model)
    assert changed.tokens != reference.tokens
    common.test_batch_of_mixed_lengths_matches_hf(changed)
