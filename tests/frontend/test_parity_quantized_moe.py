"""Quantized mixture-of-experts checkpoints through the multi-process engine against
transformers: greedy parity with chunked prefill and prefix-cache hits.

On the tiny Qwen3-MoE (a dense first layer, then a layer of eight experts, two per token):

- compressed-tensors W4A16 (pack-quantized, group 32; every decoder linear and every expert
  quantized, written by compressed-tensors' own compressor): transformers loads the checkpoint
  itself through its compressed-tensors integration (which decompresses the experts into its
  stacked tensors); conveyor runs the experts on the 4-bit kernel;
- ``fp8`` experts, block-wise (24 x 24 blocks: the tiny experts' 32 x 64 and 64 x 32 matrices
  end in partial blocks, as a real model's do where 128 does not divide) and per tensor:
  transformers runs FP8 dequantized on a CPU, so its reference is the float model with each
  expert's weight replaced by what the codes mean (the writer's, computed before saving);
  conveyor multiplies the experts out once at load.

One engine per checkpoint, the prompts of test_parity_hf, the float32 parity tolerance: the
experts' inputs are not quantized by any of these schemes as run here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.fixtures.model_maker import ensure_model
from benchmarks.fixtures.quantized_maker import ensure_quantized, reference_weights
from tests.frontend.test_parity_hf import LOGPROB_TOLERANCE, TIE_GAP, Reference
from tests.frontend.test_parity_quantized import ACTIVATION_TOLERANCE, run_parity

CASES = [
    ("compressed-tensors-moe", dict(preset="W4A16", group=32), "load"),
    ("gptq", dict(bits=8), "writer"),  # 8-bit experts: the int8 kernel's grouped path
    ("gptq", dict(desc_act=True), "writer"),  # act-order experts, sorted by group at load
    ("compressed-tensors-moe", dict(preset="W8A8", group=0), "load"),
    ("fp8-moe", dict(block=24), "writer"),
    ("fp8-moe", dict(), "writer"),
]


def _case_id(case) -> str:
    kind, options, _ = case
    return "-".join([kind, *(f"{k}={v}" for k, v in sorted(options.items()))])


def hf_moe_with_weights(source: Path, weights: dict[str, torch.Tensor]):
    """transformers' float model with each expert's gate, up and down weight replaced (its
    experts are stacked, [gate; up] per expert, as ours are), and any other linear's weight
    (a GPTQ checkpoint quantizes the attention and dense MLPs too)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, weight in weights.items():
            if ".experts." not in name:
                params[name].copy_(weight)
                continue
            block, _, rest = name.partition(".experts.")
            expert, part, _ = rest.split(".")
            if part == "down_proj":
                params[f"{block}.experts.down_proj"][int(expert)].copy_(weight)
            else:
                rows = params[f"{block}.experts.gate_up_proj"][int(expert)]
                start = 0 if part == "gate_proj" else rows.shape[0] // 2
                rows[start : start + weight.shape[0]].copy_(weight)
    return model


@pytest.fixture(scope="module", params=CASES, ids=_case_id)
def quantized_reference(request) -> Reference:
    from transformers import AutoModelForCausalLM

    kind, options, how = request.param
    source = ensure_model("tiny", "qwen3_moe")
    model_dir = ensure_quantized(source, kind, **options)
    if how == "load":
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    else:
        weights = reference_weights(model_dir)
        assert any(".experts." in name for name in weights)
        model = hf_moe_with_weights(source, weights)
    reference = Reference(model_dir, model)
    reference.tolerance, reference.tie_gap = LOGPROB_TOLERANCE, TIE_GAP
    if options.get("preset") == "W8A8":  # activations rounded to int8: see that module
        reference.tolerance = reference.tie_gap = ACTIVATION_TOLERANCE
    reference.fp8_torch_path = False
    return reference


def test_quantized_experts_match_hf_with_chunked_prefill_and_prefix_hits(quantized_reference):
    run_parity(quantized_reference)
