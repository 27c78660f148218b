"""``--quantization int8`` against transformers on the same int8 weights: greedy parity.

transformers runs the checkpoint with each decoder linear's weight and the LM head's (untied from
the embeddings, which stay float) replaced by what the engine computes with, ``q * scale`` from
``quantize_int8`` (one scale per output row); the engine runs
the checkpoint with ``quantization="int8"``. The engine fuses q/k/v and gate/up where HF keeps
them apart, which changes nothing: a row's scale depends on that row alone. The
mixture-of-experts families (Qwen3-MoE, Mixtral) quantize every expert's matrices too; the routers
stay float. The tokens must be the same and the logprobs within the float32 parity tests' tolerance (the kernel sums x * q and
scales once, HF multiplies by q * scale: the two differ by float rounding only). A near tie is
reported by name, as in test_parity_hf.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conveyor.frontend import LLM
from conveyor.protocol import SamplingParams
from conveyor.worker.layers.int8_linear import quantize_int8
from tests.conftest import MOE_ARCHS
from tests.frontend.test_parity_hf import (
    ARCHS,
    BLOCK_SIZE,
    GREEDY,
    SMALL_KV,
    Reference,
    _check,
    _reference,
)

# The linears the engine quantizes, by their transformers names, and the experts' stacked
# matrices ([experts, out, in] in transformers 5, as in the engine: a row is an output feature).
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
STACKED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def _int8_hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    replaced = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(tuple(f"{n}.weight" for n in QUANTIZED)):
                matrices = [param]
            elif name.endswith(STACKED_EXPERTS):
                matrices = list(param)
            else:
                continue
            for matrix in matrices:
                q, scale = quantize_int8(matrix)
                matrix.copy_(q.float() * scale[:, None])
            replaced += 1
    # Per layer: q, k, v, o, and gate, up, down (dense) or the two stacked expert matrices.
    names = {name for name, _ in model.named_parameters()}
    expected = sum(
        4 + (2 if f"model.layers.{i}.mlp.experts.gate_up_proj" in names else 3)
        for i in range(model.config.num_hidden_layers)
    )
    assert replaced == expected
    # The LM head too, untied from the embeddings (which stay float).
    head = model.get_output_embeddings().weight.detach().clone()
    q, scale = quantize_int8(head)
    dequantized = q.float() * scale[:, None]
    model.get_output_embeddings().weight = torch.nn.Parameter(dequantized, requires_grad=False)
    assert not torch.equal(model.get_input_embeddings().weight, dequantized)
    return model


_REFERENCES: dict[Path, Reference] = {}


@pytest.fixture(scope="module", params=ARCHS + MOE_ARCHS)
def int8_reference(request, tiny_model_dirs, tiny_moe_model_dirs) -> Reference:
    dirs = tiny_model_dirs if request.param in ARCHS else tiny_moe_model_dirs
    model_dir = dirs[request.param]
    if model_dir not in _REFERENCES:
        _REFERENCES[model_dir] = Reference(model_dir, _int8_hf_model(model_dir))
    return _REFERENCES[model_dir]


def _llm(reference: Reference, **engine_args) -> LLM:
    # On the CPU in float32 in a CUDA test run too: int8 weights run on CPU only.
    return LLM(
        str(reference.model_dir),
        engine="inprocess",
        block_size=BLOCK_SIZE,
        seed=0,
        dtype="float32",
        device="cpu",
        kv_cache_memory=SMALL_KV,
        quantization="int8",
        **engine_args,
    )


def test_int8_batch_with_chunked_prefill_matches_hf_on_int8_weights(int8_reference):
    # Chunks of 16 tokens next to decodes: the kernel's few-row path (decodes alone) and its
    # many-row path (chunks) both run.
    with _llm(int8_reference, max_num_seqs=8, max_num_batched_tokens=16) as llm:
        outputs = llm.generate(int8_reference.prompts, GREEDY, use_tqdm=False)
        _check(int8_reference, outputs, list(range(len(int8_reference.prompts))))
        llm.check_all_free()


def test_the_int8_reference_is_not_the_float_model(int8_reference, hf_model):
    # The int8 rounding moves the first logits (same context in both: the prompt) by far more
    # than the parity tolerance, so passing the test above means the engine ran int8 weights.
    float_reference = _reference(int8_reference.model_dir, hf_model)
    gaps = [
        (ours[0] - theirs[0]).abs().max().item()
        for ours, theirs in zip(int8_reference.logits, float_reference.logits)
    ]
    assert min(gaps) > 1e-3


def test_int8_keeps_the_trained_default_models_greedy_text():
    # The random-weight models above say the engine computes what int8 weights compute, not
    # how close that is to the float model. The embedded default model is trained: on these
    # prompts its int8 weights gave the float32 model's greedy tokens, all 192 (measured when
    # the path landed). Three quarters is the bar: a near tie may flip one prompt's tail.
    prompts = ["def add(a, b):", "import os\n\n", "class Stack:\n    def __init__(self):",
               "for i in range(10):", "    def __repr__(self):", "try:\n    import json\nexcept"]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=0)
    outputs = {}
    for quantization in (None, "int8"):
        with LLM(None, quantization=quantization, engine="inprocess", device="cpu") as llm:
            outputs[quantization] = llm.generate(prompts, params, use_tqdm=False)
    agreeing, logprob_gaps = 0, []
    for ours, theirs in zip(outputs["int8"], outputs[None]):
        a, b = ours.outputs[0], theirs.outputs[0]
        agreeing += next(
            (i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
            len(a.token_ids),
        )
        first = a.token_ids[0]
        if first == b.token_ids[0]:
            logprob_gaps.append(abs(a.logprobs[0][first] - b.logprobs[0][first]))
    assert agreeing >= 0.75 * 32 * len(prompts), f"{agreeing} of {32 * len(prompts)} tokens"
    # ... and the int8 run was one: its logprobs are not the float model's.
    assert max(logprob_gaps) > 1e-4, logprob_gaps
