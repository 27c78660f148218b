"""The compiled 4-bit linear (csrc/int4_gemm.c, worker/layers/quantization/int4_kernel.py) and
``--quantization int4``, against torch's matmul on the same dequantized weights.

The kernel sums x * code per group and applies scale and zero once per group; torch multiplies
by (code - zero) * scale. The two differ by float rounding: the bound is a few float32 ulps of
the sum of |x| * |w| per output, as for the int8 kernel.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.fixtures.quantized_maker import ensure_quantized, reference_weights
from conveyor.worker.layers.quantization.int4_kernel import (
    AMX_MIN_ROWS,
    Int4Panels,
    load_int4_gemm,
    quantize_int4,
)
from conveyor.worker.loader import ModelLoadError, load_model

pytestmark = pytest.mark.skipif(load_int4_gemm() is None, reason="no C compiler for the kernel")


def _dequantized(codes, scales, zeros, group_size):
    return (codes.float() - zeros.repeat_interleave(group_size, 1)) * scales.repeat_interleave(
        group_size, 1
    )


def _close(out, x, weight, bias=None):
    reference = x @ weight.T + (0 if bias is None else bias)
    bound = (x.abs() @ weight.abs().T) * (x.shape[-1] * 2**-22) + 1e-6
    error = (out - reference).abs()
    assert bool((error <= bound).all()), f"max error {error.max():.3g}"


AMX_REASON = "the AMX path needs a host with AMX-BF16 and Linux 5.16 or later (tile state)"


@pytest.fixture(params=["avx", "amx"])
def path(request):
    """Each path of the kernel: "avx" the 6-row tile (and from GEMM_MIN_ROWS the float32 weight
    and torch's GEMM), "amx" the tiles from AMX_MIN_ROWS rows where the host has AMX."""
    gemm = load_int4_gemm()
    wanted = gemm.amx
    if request.param == "amx" and not wanted:
        pytest.skip(AMX_REASON)
    gemm.set_amx(request.param == "amx")
    yield request.param
    gemm.set_amx(wanted)


# From GEMM_MIN_ROWS (256) rows the weight is written in float32 and multiplied by torch.
@pytest.mark.parametrize("rows", [1, 2, 6, 7, 8, 13, 16, 17, 96, 97, 200, 256, 301])
@pytest.mark.parametrize(
    ("out_features", "in_features", "group_size"),
    [(64, 64, 32), (17, 64, 64), (130, 256, 128), (300, 128, 32), (8, 96, 96), (70, 512, 256)],
)
def test_kernel_matches_torch_on_the_dequantized_weight(
    path, rows, out_features, in_features, group_size
):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    codes, scales, _ = quantize_int4(weight, group_size)
    zeros = torch.randint(0, 16, scales.shape, generator=generator).float()  # asymmetric
    panels = Int4Panels(load_int4_gemm(), codes, scales, zeros, group_size)
    x = torch.randn(rows, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    dequantized = _dequantized(codes, scales, zeros, group_size)
    _close(panels.linear(x, bias), x, dequantized, bias)
    _close(panels.linear(x, None), x, dequantized)
    # A strided input (a slice of a wider tensor) and a leading batch dimension.
    wide = torch.randn(rows, in_features + 5, generator=generator)[:, :in_features]
    _close(panels.linear(wide.unsqueeze(0), None)[0], wide, dequantized)


@pytest.mark.skipif(not (load_int4_gemm() and load_int4_gemm().amx), reason=AMX_REASON)
def test_amx_rows_do_not_depend_on_their_company_or_the_threads():
    """A row's result on the AMX path is the same bits whatever other rows share the call (each
    row of a tile is multiplied on its own), for every count from AMX_MIN_ROWS rows, and on 1 or
    2 threads (a panel is one thread's); below AMX_MIN_ROWS the 6-row tile runs, whose rows are
    just as independent of each other."""
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(200, 384, generator=generator)
    codes, scales, _ = quantize_int4(weight, 128)
    zeros = torch.randint(0, 17, scales.shape, generator=generator).float()
    panels = Int4Panels(load_int4_gemm(), codes, scales, zeros, 128)
    x = torch.randn(300, 384, generator=generator)
    whole = panels.linear(x, None)
    least = AMX_MIN_ROWS
    for start, stop in [(0, least), (0, least + 1), (5, 5 + least + 3), (40, 56), (100, 300)]:
        assert torch.equal(panels.linear(x[start:stop], None), whole[start:stop]), (start, stop)
    few = panels.linear(x[10 : 10 + least - 1], None)
    for start, stop in [(10, 11), (10, 12), (11, 9 + least), (12, 10 + least - 1)]:
        part = panels.linear(x[start:stop], None)
        assert torch.equal(part, few[start - 10 : stop - 10]), (start, stop)
    _close(few, x[10 : 10 + least - 1], _dequantized(codes, scales, zeros, 128))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(panels.linear(x[:64], None), whole[:64])
    finally:
        torch.set_num_threads(threads)


def test_panels_keep_the_codes_at_four_bits_and_give_them_back():
    weight = torch.randn(100, 128, generator=torch.Generator().manual_seed(1))
    codes, scales, zeros = quantize_int4(weight, 64)
    panels = Int4Panels(load_int4_gemm(), codes, scales, zeros, 64)
    width = panels.gemm.panel_width
    assert panels.codes.nbytes == -(-100 // width) * width * 128 // 2  # two codes per byte
    back = panels.unpacked()
    assert all(torch.equal(a, b) for a, b in zip(back, (codes, scales, zeros)))


@pytest.mark.parametrize(("out_features", "group_size"), [(17, 32), (130, 64), (300, 128)])
def test_the_float_weight_written_for_many_rows_is_the_dequantized_one(out_features, group_size):
    generator = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, 256, generator=generator)
    codes, scales, _ = quantize_int4(weight, group_size)
    zeros = torch.randint(0, 17, scales.shape, generator=generator).float()
    panels = Int4Panels(load_int4_gemm(), codes, scales, zeros, group_size)
    expected = _dequantized(codes, scales, zeros, group_size)
    assert torch.equal(panels.dequantized_t(), expected.T)  # (u - z) * s, exactly


def test_quantize_int4_is_within_half_a_step():
    weight = torch.randn(32, 128, generator=torch.Generator().manual_seed(2)) * 3
    codes, scales, zeros = quantize_int4(weight, 64)
    assert int(codes.min()) >= 1 and int(codes.max()) <= 15 and bool((zeros == 8).all())
    error = (_dequantized(codes, scales, zeros, 64) - weight).abs()
    assert bool((error <= scales.repeat_interleave(64, 1) / 2 + 1e-6).all())


def test_4bit_checkpoints_run_through_the_kernel(tiny_model_dirs):
    model_dir = ensure_quantized(tiny_model_dirs["qwen3"], "awq")
    model = load_model(model_dir, torch.float32, "cpu")
    down = model.model.layers[0].mlp.down_proj
    assert down.quant.panels is not None and "codes" not in down.quant._parameters
    reference = reference_weights(model_dir)["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(down.quant.dequantized(), reference)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(3))
    _close(down(x), x, reference)


def test_int4_at_load_quantizes_every_decoder_linear(tiny_model_dirs, tiny_moe_model_dirs):
    float_model = load_model(tiny_model_dirs["llama"], torch.float32, "cpu")
    model = load_model(tiny_model_dirs["llama"], torch.float32, "cpu", quantization="int4")
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        ours = model.model.layers[1].get_submodule(name)
        weight = float_model.model.layers[1].get_submodule(name).weight
        assert ours.quant.panels is not None and ours.weight.device.type == "meta"
        codes, scales, zeros = quantize_int4(weight, 64)
        assert torch.equal(ours.quant.dequantized(), _dequantized(codes, scales, zeros, 64))
    # The LM head's logits read a 4-bit copy; the embedding lookups keep the float table.
    head = float_model.lm_head.weight
    codes, scales, zeros = quantize_int4(head, 64)
    back = model.lm_head.quantized.unpacked()
    assert all(torch.equal(a, b) for a, b in zip(back, (codes, scales, zeros)))
    assert torch.equal(model.model.embed_tokens.weight, float_model.model.embed_tokens.weight)
    with pytest.raises(ModelLoadError, match="int4 does not quantize mixture-of-experts"):
        load_model(tiny_moe_model_dirs["qwen3_moe"], torch.float32, "cpu", quantization="int4")
