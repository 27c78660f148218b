"""Greedy parity of LoRA adapters with transformers + PEFT, through the multi-process engine.

The adapters are PEFT's own (``get_peft_model`` on the tiny random-weight models, random
non-zero B, ``save_pretrained``), of ranks 8, 64 and 16 (rsLoRA) on different target modules;
the reference is PEFT applying them to the same base (never merged by us). One engine per
family runs a batch that mixes the three adapters and the base model with chunked prefill; the
same prompt under two adapters must not share KV blocks. With fewer slots than adapters and a
tiny KV pool, adapters swap and requests are preempted, and not a token changes; on two
tensor-parallel ranks too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks.fixtures.lora_maker import make_adapter, peft_greedy
from conveyor import LLM, LoRARequest, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("parity-lora")]

NUM_NEW_TOKENS = 12
BLOCK_SIZE = 16
PROMPT_LENGTHS = (5, 9, 17, 30, 44, 52, 60, 23)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
# name -> (rank, targets, seed, use_rslora)
ADAPTERS = {
    "r8": (8, ["q_proj", "v_proj", "o_proj"], 1, False),
    "r64": (64, ["k_proj", "gate_proj", "up_proj", "down_proj"], 2, False),
    "rs16": (
        16,
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        3,
        True,
    ),
}
# Which adapter each prompt runs under (None: the base model): all four in every batch.
PLAN = [None, "r8", "r64", "rs16", "r8", "r64", "rs16", None]


class LoRAReference:
    """The adapters of one family and PEFT's greedy tokens for every (prompt, adapter) used."""

    def __init__(self, model_dir: Path, folder: Path) -> None:
        self.model_dir = model_dir
        rng = np.random.default_rng(7)
        self.prompts = [rng.integers(3, 2000, n).tolist() for n in PROMPT_LENGTHS]
        self.paths = {
            name: make_adapter(model_dir, folder / name, rank, targets, seed, use_rslora=rslora)
            for name, (rank, targets, seed, rslora) in ADAPTERS.items()
        }
        self.requests = {
            name: LoRARequest(name, i + 1, str(path))
            for i, (name, path) in enumerate(self.paths.items())
        }
        self._tokens: dict[tuple[int, str | None], list[int]] = {}

    def tokens(self, index: int, adapter: str | None) -> list[int]:
        key = (index, adapter)
        if key not in self._tokens:
            path = self.paths[adapter] if adapter else None
            [self._tokens[key]] = peft_greedy(
                self.model_dir, path, [self.prompts[index]], NUM_NEW_TOKENS
            )
        return self._tokens[key]

    def lora(self, adapter: str | None) -> LoRARequest | None:
        return self.requests[adapter] if adapter else None


_REFERENCES: dict[str, LoRAReference] = {}


def _reference(arch: str, tiny_model_dirs, tmp_path_factory) -> LoRAReference:
    if arch not in _REFERENCES:
        folder = tmp_path_factory.mktemp(f"lora-{arch}")
        _REFERENCES[arch] = LoRAReference(tiny_model_dirs[arch], folder)
    return _REFERENCES[arch]


# The engine of the mixed batches: three adapters of ranks up to 64 in one step, float32.
MIXED = dict(
    dtype="float32", block_size=BLOCK_SIZE, enable_lora=True, max_loras=3, max_lora_rank=64
)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def reference(request, tiny_model_dirs, tmp_path_factory) -> LoRAReference:
    return _reference(request.param, tiny_model_dirs, tmp_path_factory)


@pytest.fixture(scope="module")
def qwen3_reference(tiny_model_dirs, tmp_path_factory) -> LoRAReference:
    return _reference("qwen3", tiny_model_dirs, tmp_path_factory)


@pytest.fixture(scope="module")
def llm(reference):
    engine = LLM(
        str(reference.model_dir), **MIXED, max_num_batched_tokens=32, max_num_seqs=8,
        kv_cache_memory=32 << 20,
    )  # fmt: skip
    try:
        yield engine
    finally:
        engine.shutdown()


def _run(llm: LLM, reference: LoRAReference, indices: list[int], plan: list[str | None]):
    prompts = [reference.prompts[i] for i in indices]
    loras = [reference.lora(a) for a in plan]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    for i, adapter, output in zip(indices, plan, outputs):
        expected = reference.tokens(i, adapter)
        assert output.outputs[0].token_ids == expected, f"prompt {i} under {adapter or 'base'}"
    return outputs


def test_the_adapters_change_the_outputs(reference):
    # Otherwise parity would prove nothing about the adapters.
    for i, adapter in enumerate(PLAN):
        if adapter is not None:
            assert reference.tokens(i, adapter) != reference.tokens(i, None), adapter


def test_a_batch_mixing_three_adapters_and_the_base_matches_peft(llm, reference):
    # Chunked prefill (32-token budget, prompts up to 60 tokens) in one mixed batch.
    _run(llm, reference, list(range(len(PLAN))), PLAN)
    llm.check_all_free()


def test_the_same_prompt_under_two_adapters_shares_no_kv(llm, reference):
    index = 6  # 60 tokens: three full blocks
    first = _run(llm, reference, [index], ["r8"])
    assert first[0].num_cached_tokens == 0
    outputs = _run(llm, reference, [index, index, index], ["r64", "r8", None])
    # Under r64 and the base model nothing is shared with r8's blocks; r8 again hits its own.
    assert [o.num_cached_tokens for o in outputs] == [0, 48, 0]
    assert outputs[0].outputs[0].token_ids != outputs[1].outputs[0].token_ids
    llm.check_all_free()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_more_adapters_than_slots_and_a_tiny_kv_pool_match_peft(qwen3_reference, async_scheduling):
    """Two slots for three adapters (swaps, waits under the cap) and 12 KV blocks for eight
    requests (preemption), one family (the scheduling paths are the same for all), with and
    without async scheduling: every token still PEFT's."""
    reference = qwen3_reference
    kv_bytes_per_block = 2 * 2 * 2 * 16 * BLOCK_SIZE * 4  # layers, K/V, kv heads, head_dim
    with LLM(
        str(reference.model_dir),
        dtype="float32",
        block_size=BLOCK_SIZE,
        enable_lora=True,
        max_loras=2,
        max_cpu_loras=2,
        max_lora_rank=64,
        max_num_seqs=8,
        kv_cache_memory=12 * kv_bytes_per_block,
        async_scheduling=async_scheduling,
    ) as llm:
        _run(llm, reference, list(range(len(PLAN))), PLAN)
        assert llm.stats is not None and llm.stats.num_preemptions > 0
        llm.check_all_free()


def test_two_tensor_parallel_ranks_match_peft(qwen3_reference):
    """Slots sharded like their layers (B by output rows on q/k/v and gate/up, A by input
    columns on o and down, the layer's all-reduce summing the partial corrections): the mixed
    batch on two ranks gives PEFT's tokens, as one rank does."""
    reference = qwen3_reference
    with LLM(
        str(reference.model_dir), **MIXED, max_num_batched_tokens=32, tensor_parallel_size=2,
        kv_cache_memory=32 << 20,
    ) as llm:  # fmt: skip
        _run(llm, reference, list(range(len(PLAN))), PLAN)


def test_attention_lora_on_a_mixture_of_experts_model_matches_peft(
    tiny_moe_model_dirs, tmp_path_factory
):
    """Qwen3-MoE's attention takes adapters like a dense model's; its MLP (the experts) does
    not, and an adapter that targets it is refused by name."""
    model_dir = tiny_moe_model_dirs["qwen3_moe"]
    folder = tmp_path_factory.mktemp("lora-moe")
    attention = make_adapter(
        model_dir, folder / "attn", 8, ["q_proj", "k_proj", "v_proj", "o_proj"], 4
    )
    experts = make_adapter(model_dir, folder / "experts", 8, ["gate_proj", "up_proj"], 5)
    prompts = [np.random.default_rng(9).integers(3, 2000, n).tolist() for n in (9, 30)]
    expected = peft_greedy(model_dir, attention, prompts, NUM_NEW_TOKENS)
    assert expected != peft_greedy(model_dir, None, prompts, NUM_NEW_TOKENS)
    with LLM(str(model_dir), dtype="float32", enable_lora=True, max_lora_rank=8) as llm:
        lora = LoRARequest("attn", 1, str(attention))
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        with pytest.raises(ValueError, match="mixture-of-experts"):
            llm.generate(prompts, GREEDY, lora_request=LoRARequest("experts", 2, str(experts)))


def test_prompt_logprobs_under_an_adapter_match_peft(llm, reference):
    """A chunked prompt's logprobs (the step runs every row through the last layer, then picks
    the prompt rows and the sampling rows) under r64 and the base model in one batch."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    index = 6  # 60 tokens: two chunks of the 32-token budget
    prompt = reference.prompts[index]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate(
        [prompt, prompt], params, use_tqdm=False, lora_request=[reference.lora("r64"), None]
    )
    for output, adapter in zip(outputs, ["r64", None]):
        model = AutoModelForCausalLM.from_pretrained(reference.model_dir, dtype=torch.float32)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, reference.paths[adapter])
        with torch.inference_mode():
            logits = model(torch.tensor([prompt])).logits[0].float()
        expected = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1), prompt[1:]]
        got = [position[token] for position, token in zip(output.prompt_logprobs[1:], prompt[1:])]
        torch.testing.assert_close(torch.tensor(got), expected, rtol=0, atol=1e-4)


def test_speculative_decoding_under_adapters_matches_peft(qwen3_reference):
    """ngram drafts verified under each adapter's slots: prompts that repeat themselves, so every
    request gets drafts from its first decode on."""
    rng = np.random.default_rng(11)
    prompts = []
    for n in (6, 9, 13, 7):
        part = rng.integers(3, 2000, n).tolist()
        prompts.append(part * 3)
    plan = [None, "r8", "r64", "rs16"]
    expected = [
        peft_greedy(
            qwen3_reference.model_dir,
            qwen3_reference.paths[a] if a else None,
            [prompt],
            NUM_NEW_TOKENS,
        )[0]
        for prompt, a in zip(prompts, plan)
    ]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2}  # fmt: skip
    with LLM(
        str(qwen3_reference.model_dir), **MIXED, max_num_seqs=8, kv_cache_memory=32 << 20,
        speculative_config=spec,
    ) as llm:  # fmt: skip
        outputs = llm.generate(
            prompts, GREEDY, use_tqdm=False, lora_request=[qwen3_reference.lora(a) for a in plan]
        )
    for adapter, output, tokens in zip(plan, outputs, expected):
        assert output.outputs[0].token_ids == tokens, adapter or "base"
