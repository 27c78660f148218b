"""Quantized checkpoints at load (worker/layers/quantization/): each format's weights against an
independent reference, tensor-parallel slices, and the refusals.

The references: compressed-tensors' own unpacking and dequantization (its checkpoints are written
by it too), the float weights the GPTQ / AWQ fixture writer's codes mean (computed before
packing, benchmarks/fixtures/quantized_maker.py), and, for the linears' activations,
transformers running the compressed-tensors checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from benchmarks.fixtures.quantized_maker import (
    compressed_tensors_dequantized,
    ensure_quantized,
    reference_weights,
)
from conveyor.worker.layers.int8_linear import load_int8_gemm
from conveyor.worker.layers.quantization.activations import fake_quantize
from conveyor.worker.layers.quantization.int4_kernel import load_int4_gemm
from conveyor.worker.layers.quantization.packing import (
    AWQ_ORDER,
    pack_int32,
    pack_nibbles,
    unpack_int32,
    unpack_nibbles,
)
from conveyor.worker.loader import ModelLoadError, load_model

CPU = "cpu"
QKV = ("q", "k", "v")


@pytest.fixture(scope="module")
def qwen3(tiny_model_dirs) -> Path:
    return tiny_model_dirs["qwen3"]


def _qkv(weights: dict, layer: int) -> torch.Tensor:
    return torch.cat([weights[f"model.layers.{layer}.self_attn.{p}_proj.weight"] for p in QKV])


def _gate_up(weights: dict, layer: int) -> torch.Tensor:
    return torch.cat([weights[f"model.layers.{layer}.mlp.{p}_proj.weight"] for p in ("gate", "up")])


def test_int32_packing_matches_compressed_tensors_own():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    values = torch.randint(-8, 8, (6, 64), dtype=torch.int8)
    theirs = pack_to_int32(values, 4)  # stores value + 8, eight to a word, lowest bits first
    assert torch.equal(unpack_int32(theirs, 4, dim=1).to(torch.int16) - 8, values.to(torch.int16))
    assert torch.equal(pack_int32((values + 8).to(torch.uint8), 4, dim=1), theirs)
    zeros = pack_to_int32(values, 4, packed_dim=0)
    assert torch.equal(unpack_int32(zeros, 4, dim=0)[:6].to(torch.int16) - 8, values.short())


def test_awq_order_and_nibbles_round_trip():
    codes = torch.randint(0, 16, (16, 24), dtype=torch.uint8)
    words = pack_int32(codes, 4, dim=1, order=AWQ_ORDER)
    # Nibble 1 of the first word holds column 2, nibble 4 column 1 (AutoAWQ's interleave).
    assert (int(words[0, 0]) >> 4) & 0xF == codes[0, 2] and (int(words[0, 0]) >> 16) & 0xF == codes[
        0, 1
    ]
    assert torch.equal(unpack_int32(words, 4, dim=1, order=AWQ_ORDER), codes)
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(sym=False),
        dict(sym=False, desc_act=True),
        dict(bits=8, group=64),
    ],
    ids=["sym", "zero-points", "act-order", "8-bit"],
)
def test_gptq_weights_equal_what_their_codes_mean(qwen3, options):
    model_dir = ensure_quantized(qwen3, "gptq", **options)
    reference = reference_weights(model_dir)
    model = load_model(model_dir, torch.float32, CPU)
    for layer in (0, 1):
        block = model.model.layers[layer]
        assert torch.equal(block.self_attn.qkv_proj.quant.dequantized(), _qkv(reference, layer))
        assert torch.equal(block.mlp.gate_up_proj.quant.dequantized(), _gate_up(reference, layer))
        down = reference[f"model.layers.{layer}.mlp.down_proj.weight"]
        assert torch.equal(block.mlp.down_proj.quant.dequantized(), down)
    quant = model.model.layers[0].mlp.down_proj.quant
    # Kept at its bits: 4-bit codes two to a byte in the kernel's panels (act-order ones, or
    # all without the kernel, in the checkpoint layout), 8-bit codes a byte each (in the int8
    # kernel's panels where it builds).
    if options.get("bits", 4) == 8 and quant.int8 is not None:
        assert quant.int8.q.dtype == torch.int8 and quant.int8.q.numel() == 64 * 128
    elif options.get("bits", 4) == 8:
        assert quant.codes.dtype == torch.uint8 and quant.codes.shape == (64, 128)
    elif quant.panels is not None:
        assert quant.panels.codes.nbytes == 64 * 64
    else:
        assert quant.codes.dtype == torch.uint8 and quant.codes.shape == (64, 64)


def test_awq_weights_equal_what_their_codes_mean(qwen3):
    model_dir = ensure_quantized(qwen3, "awq")
    reference = reference_weights(model_dir)
    model = load_model(model_dir, torch.float32, CPU)
    for layer in (0, 1):
        assert torch.equal(
            model.model.layers[layer].self_attn.qkv_proj.quant.dequantized(), _qkv(reference, layer)
        )
        o_proj = reference[f"model.layers.{layer}.self_attn.o_proj.weight"]
        assert torch.equal(model.model.layers[layer].self_attn.o_proj.quant.dequantized(), o_proj)


@pytest.mark.parametrize(
    ("preset", "group"),
    [
        ("W4A16", 32),
        ("W4A16_ASYM", 32),
        ("W8A16", 32),
        ("W8A16", "channel"),
        ("W8A8", 0),
        ("FP8", 0),
        ("FP8_DYNAMIC", 0),
    ],
)
def test_compressed_tensors_weights_equal_its_own_decompression(qwen3, preset, group):
    options = dict(strategy=group) if isinstance(group, str) else dict(group=group)
    model_dir = ensure_quantized(qwen3, "compressed-tensors", preset=preset, **options)
    reference = compressed_tensors_dequantized(model_dir)
    model = load_model(model_dir, torch.float32, CPU)
    for layer in (0, 1):
        block = model.model.layers[layer]
        assert torch.equal(block.self_attn.qkv_proj.quant.dequantized(), _qkv(reference, layer))
        assert torch.equal(block.mlp.gate_up_proj.quant.dequantized(), _gate_up(reference, layer))


@pytest.mark.parametrize("preset", ["W8A8", "FP8", "FP8_DYNAMIC"])
def test_quantized_activations_match_compressed_tensors_forward(qwen3, preset):
    # transformers runs compressed-tensors' own forward: each input quantized and dequantized
    # (int8 or fp8, per token or by the static input scale) before the float matmul.
    from transformers import AutoModelForCausalLM

    model_dir = ensure_quantized(qwen3, "compressed-tensors", preset=preset, group=0)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf(torch.tensor([[1, 2]]))  # decompresses the weights
    ours = load_model(model_dir, torch.float32, CPU)
    x = torch.randn(1, 7, 64, generator=torch.Generator().manual_seed(0)) * 3
    with torch.no_grad():
        theirs = torch.cat([getattr(hf.model.layers[0].self_attn, f"{p}_proj")(x) for p in QKV], -1)
        mine = ours.model.layers[0].self_attn.qkv_proj(x)
        plain = x @ ours.model.layers[0].self_attn.qkv_proj.quant.dequantized().T
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    assert (mine - plain).abs().max() > 1e-3  # the activations were quantized


def test_tensor_parallel_ranks_hold_slices_of_the_single_rank_weights(qwen3):
    model_dir = ensure_quantized(qwen3, "gptq", sym=False)
    whole = load_model(model_dir, torch.float32, CPU)
    ranks = [load_model(model_dir, torch.float32, CPU, tp_rank=r, tp_size=2) for r in (0, 1)]
    full_down = whole.model.layers[1].mlp.down_proj.quant.dequantized()
    halves = [m.model.layers[1].mlp.down_proj.quant.dequantized() for m in ranks]
    assert torch.equal(torch.cat(halves, dim=1), full_down)  # row-parallel: input columns
    full_gate_up = whole.model.layers[1].mlp.gate_up_proj.quant.dequantized()
    gate, up = full_gate_up.split(128)
    for r, model in enumerate(ranks):
        part = model.model.layers[1].mlp.gate_up_proj.quant.dequantized()
        assert torch.equal(
            part, torch.cat([gate[64 * r : 64 * (r + 1)], up[64 * r : 64 * (r + 1)]])
        )


def _edited_copy(source: Path, dest: Path, quant_config=None, drop=(), rename=None) -> Path:
    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    if quant_config is not None:
        config["quantization_config"] = {**config["quantization_config"], **quant_config}
    (dest / "config.json").write_text(json.dumps(config))
    if drop or rename:
        with safe_open(source / "model.safetensors", "pt") as f:
            tensors = {n: f.get_tensor(n) for n in f.keys() if not any(d in n for d in drop)}  # noqa: SIM118
        if rename:
            tensors = {rename(n): t for n, t in tensors.items()}
        save_file(tensors, str(dest / "model.safetensors"))
    return dest


@pytest.mark.parametrize(
    ("kind", "options", "edit", "message"),
    [
        ("gptq", {}, {"bits": 3}, "gptq with 3-bit weights"),
        ("gptq", {}, {"dynamic": {"-:.*down": {}}}, "per-module overrides"),
        ("awq", {}, {"version": "gemv"}, "awq version 'gemv'"),
        ("awq", {}, {"zero_point": False}, "awq without zero points"),
        ("compressed-tensors", {"preset": "W4A16", "group": 32},
         {"sparsity_config": {"format": "sparse-24-bitmask"}}, r"sparsity \(e.g. 2:4\)"),
        ("compressed-tensors", {"preset": "W4A16", "group": 32}, {"format": "marlin-24"},
         "format 'marlin-24'"),
        ("compressed-tensors", {"preset": "W4A16", "group": 32},
         {"kv_cache_scheme": {"num_bits": 8}}, "KV cache quantization"),
        ("compressed-tensors", {"preset": "W4A16", "group": 32}, {"quant_method": "bitsandbytes"},
         "bitsandbytes-quantized checkpoints are not loaded"),
    ],
)  # fmt: skip
def test_what_conveyor_does_not_run_is_refused_at_load_by_name(
    qwen3, tmp_path, kind, options, edit, message
):
    source = ensure_quantized(qwen3, kind, **options)
    if kind == "compressed-tensors" and "format" in edit:
        config = json.loads((source / "config.json").read_text())["quantization_config"]
        group = {**config["config_groups"]["group_0"], "format": edit["format"]}
        edit = {"format": edit["format"], "config_groups": {"group_0": group}}
    model_dir = _edited_copy(source, tmp_path / "m", edit)
    with pytest.raises(ModelLoadError, match=message):
        load_model(model_dir, torch.float32, CPU)


def test_a_quantization_flag_that_is_not_the_checkpoint_is_refused(qwen3):
    with pytest.raises(ModelLoadError, match="--quantization awq, but the checkpoint is gptq"):
        load_model(ensure_quantized(qwen3, "gptq"), torch.float32, CPU, quantization="awq")
    with pytest.raises(ModelLoadError, match="int8 quantizes a float checkpoint.*already gptq"):
        load_model(ensure_quantized(qwen3, "gptq"), torch.float32, CPU, quantization="int8")
    with pytest.raises(ModelLoadError, match="--quantization gptq, but the checkpoint is not"):
        load_model(qwen3, torch.float32, CPU, quantization="gptq")


def test_act_order_with_tensor_parallel_row_layers_is_refused(qwen3):
    model_dir = ensure_quantized(qwen3, "gptq", sym=False, desc_act=True)
    with pytest.raises(ModelLoadError, match=r"act-order \(desc_act\) weights with tensor par"):
        load_model(model_dir, torch.float32, CPU, tp_rank=0, tp_size=2)


def test_a_quantized_module_we_run_in_float_is_refused(qwen3, tmp_path):
    # A quantized LM head (or router, or expert) has no quantized layer to land in.
    source = ensure_quantized(qwen3, "gptq")
    model_dir = _edited_copy(
        source, tmp_path / "m", rename=lambda n: n.replace("layers.1.mlp.down_proj", "lm_head")
    )
    config = json.loads((model_dir / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="quantized modules conveyor does not run.*lm_head"):
        load_model(model_dir, torch.float32, CPU)


@pytest.mark.parametrize(
    ("kind", "options", "kernel"),
    [
        ("gptq", dict(desc_act=True), "panels"),
        ("gptq", dict(bits=8), "int8"),
        ("compressed-tensors-moe", dict(preset="W8A8", group=0), "w8a8"),
    ],
    ids=["act-order", "8-bit", "W8A8"],
)
def test_integer_expert_variants_run_in_the_dense_layers_kernels(
    tiny_moe_model_dirs, kind, options, kernel
):
    """Act-order, 8-bit and W8A8 experts load as each expert's pair of quantized linears, which
    take the kernels a dense layer of that scheme takes (where the host builds them)."""
    model = load_model(
        ensure_quantized(tiny_moe_model_dirs["qwen3_moe"], kind, **options), torch.float32, CPU
    )
    experts = next(
        layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts")
    )
    quant = experts.quantized_expert(0).down_proj.quant
    runs = {"panels": load_int4_gemm(), "int8": load_int8_gemm()}
    runs["w8a8"] = runs["int8"] and runs["int8"].w8a8
    if not runs[kernel]:
        pytest.skip(f"no {kernel} kernel on this host")
    assert getattr(quant, kernel) is not None and "codes" not in quant._parameters


@pytest.mark.parametrize(
    ("kind", "options"),
    [
        ("compressed-tensors-moe", dict(preset="FP8_DYNAMIC", group=0)),  # per channel
        ("fp8-moe", dict(block=24)),
    ],
)
def test_fp8_experts_are_multiplied_out_to_what_the_checkpoint_means(
    tiny_moe_model_dirs, kind, options
):
    model_dir = ensure_quantized(tiny_moe_model_dirs["qwen3_moe"], kind, **options)
    if kind == "fp8-moe":
        reference = reference_weights(model_dir)
    else:  # compressed-tensors' own decompression
        reference = compressed_tensors_dequantized(model_dir)
    experts = load_model(model_dir, torch.float32, CPU).model.layers[1].mlp.experts
    assert experts.quant_scheme is None and experts.gate_up_proj.dtype == torch.float32
    prefix = "model.layers.1.mlp.experts"
    for e in range(8):
        parts = [reference[f"{prefix}.{e}.{p}_proj.weight"] for p in ("gate", "up", "down")]
        assert torch.equal(experts.gate_up_proj[e], torch.cat(parts[:2]))
        assert torch.equal(experts.down_proj[e], parts[2])


def test_mixtral_4bit_experts_load_under_its_names(tiny_moe_model_dirs):
    # block_sparse_moe.experts.E.w1 / w3 / w2 land in expert E's gate_up and down linears.
    model_dir = ensure_quantized(tiny_moe_model_dirs["mixtral"], "gptq")
    reference = reference_weights(model_dir)
    experts = load_model(model_dir, torch.float32, CPU).model.layers[1].mlp.experts
    x = torch.randn(3, 64)
    prefix = "model.layers.1.block_sparse_moe.experts"
    for e in (0, 7):
        w1, w2, w3 = (reference[f"{prefix}.{e}.{w}.weight"] for w in ("w1", "w2", "w3"))
        assert experts.quantized_expert(e).gate_up_proj.quant.panels is not None
        torch.testing.assert_close(experts.project(x, e, 0), x @ torch.cat([w1, w3]).T)
        h = torch.randn(3, w2.shape[1])
        torch.testing.assert_close(experts.project(h, e, 1), h @ w2.T)


def test_fp8_experts_with_static_input_scales_are_refused(tiny_moe_model_dirs, tmp_path):
    source = ensure_quantized(tiny_moe_model_dirs["qwen3_moe"], "fp8-moe")
    model_dir = _edited_copy(source, tmp_path / "m", {"activation_scheme": "static"})
    with pytest.raises(ModelLoadError, match="static input scales on FP8 experts"):
        load_model(model_dir, torch.float32, CPU)


def test_4bit_experts_split_across_ranks_as_float_experts_do(tiny_moe_model_dirs):
    # Each rank's experts hold their share of every expert's intermediate features: [gate_r;
    # up_r] rows and down's columns (whole groups of 16), their partial down sums add up.
    model_dir = ensure_quantized(
        tiny_moe_model_dirs["qwen3_moe"], "compressed-tensors-moe", preset="W4A16", group=16
    )
    experts = [
        load_model(model_dir, torch.float32, CPU, tp_rank=r, tp_size=s).model.layers[1].mlp.experts
        for r, s in ((0, 1), (0, 2), (1, 2))
    ]
    assert all(e.quantized_expert(0).down_proj.quant.panels is not None for e in experts)
    x, h = torch.randn(3, 64), torch.randn(3, 32)
    for expert in (0, 7):
        gate, up = experts[0].project(x, expert, 0).chunk(2, -1)
        halves = [e.project(x, expert, 0).chunk(2, -1) for e in experts[1:]]
        torch.testing.assert_close(torch.cat([g for g, _ in halves], -1), gate)
        torch.testing.assert_close(torch.cat([u for _, u in halves], -1), up)
        partial = [
            e.project(h[:, 16 * r : 16 * (r + 1)], expert, 1) for r, e in enumerate(experts[1:])
        ]
        torch.testing.assert_close(sum(partial), experts[0].project(h, expert, 1))


@pytest.mark.parametrize(
    ("kind", "options"),
    [
        ("compressed-tensors", dict(preset="W8A16", strategy="channel")),
        ("compressed-tensors", dict(preset="W8A16", group=32)),
        ("gptq", dict(bits=8, group=64)),
        ("gptq", dict(bits=8, group=64, sym=False)),
    ],
    ids=["W8A16-channel", "W8A16-group32", "gptq8-group64", "gptq8-zero-points"],
)
def test_8bit_weights_run_in_the_int8_kernel(qwen3, kind, options):
    """8-bit weights without act-order go to the compiled int8 kernel as their codes are: one
    scale per output row (llm-compressor's W8A16 default, what --quantization int8 makes at
    load), or a scale (and a zero point) per group (GPTQ 8-bit, W8A16 with groups), the
    checkpoint layout released; the linear equals x @ W^T of the weight the format means."""
    if load_int8_gemm() is None:
        pytest.skip("no C compiler for the int8 kernel")
    model_dir = ensure_quantized(qwen3, kind, **options)
    if kind == "gptq":
        reference = reference_weights(model_dir)
    else:
        reference = compressed_tensors_dequantized(model_dir)
    model = load_model(model_dir, torch.float32, CPU)
    for module, weight in [
        (model.model.layers[0].mlp.down_proj, reference["model.layers.0.mlp.down_proj.weight"]),
        (model.model.layers[1].self_attn.qkv_proj, _qkv(reference, 1)),
    ]:
        assert module.quant.int8 is not None and "codes" not in module.quant._parameters
        assert torch.equal(module.quant.dequantized(), weight)
        x = torch.randn(5, weight.shape[1], generator=torch.Generator().manual_seed(0))
        expected = x @ weight.T
        bound = (x.abs() @ weight.abs().T) * (weight.shape[1] * 2**-22) + 1e-6
        assert bool(((module(x) - expected).abs() <= bound).all())


def test_w8a8_checkpoints_run_the_int8_kernels_integer_path(qwen3):
    """W8A8 (int8 weights per output row, int8 activations per token) goes to the int8 kernel's
    VNNI path where the host has it: the checkpoint layout released, the weight the one
    compressed-tensors decompresses, and the linear the torch path's fake-quantized product."""
    gemm = load_int8_gemm()
    if gemm is None or not gemm.w8a8:
        pytest.skip("the W8A8 path needs the int8 kernel built with AVX-512 VNNI")
    model_dir = ensure_quantized(qwen3, "compressed-tensors", preset="W8A8", group=0)
    reference = compressed_tensors_dequantized(model_dir)
    model = load_model(model_dir, torch.float32, CPU)
    down = model.model.layers[0].mlp.down_proj
    assert down.quant.w8a8 is not None and "codes" not in down.quant._parameters
    weight = reference["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(down.quant.dequantized(), weight)
    x = torch.randn(5, weight.shape[1], generator=torch.Generator().manual_seed(0)) * 3
    quantized = fake_quantize(x, "int", "token")
    expected = quantized @ weight.T
    bound = (quantized.abs() @ weight.abs().T) * (weight.shape[1] * 2**-22) + 1e-6
    assert bool(((down(x) - expected).abs() <= bound).all())


@pytest.mark.parametrize(
    "options",
    [dict(sym=False, desc_act=True), dict(bits=8, group=64, desc_act=True)],
    ids=["4-bit", "8-bit"],
)
def test_act_order_weights_run_in_the_kernels_sorted_by_group(qwen3, options):
    """GPTQ's act-order (desc_act) weights, their input features sorted by group at load, are
    group-wise weights of a permuted input: they run in the 4-bit or int8 kernel with x gathered
    into that order, and mean what the checkpoint's codes mean."""
    model_dir = ensure_quantized(qwen3, "gptq", **options)
    reference = reference_weights(model_dir)
    model = load_model(model_dir, torch.float32, CPU)
    down = model.model.layers[0].mlp.down_proj
    kernel = down.quant.panels if options.get("bits", 4) == 4 else down.quant.int8
    if kernel is None:
        pytest.skip("no C compiler for the kernels")
    assert down.quant.input_order is not None and "codes" not in down.quant._parameters
    weight = reference["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(down.quant.dequantized(), weight)
    x = torch.randn(5, weight.shape[1], generator=torch.Generator().manual_seed(0))
    bound = (x.abs() @ weight.abs().T) * (weight.shape[1] * 2**-22) + 1e-6
    assert bool(((down(x) - x @ weight.T).abs() <= bound).all())
