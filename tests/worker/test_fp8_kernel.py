"""The compiled FP8 linear (worker/layers/csrc/fp8_gemm.c) against the torch path on the same
weights: the activations rounded to e4m3 by the same function, the weight dequantized.

The kernel multiplies the codes exactly (bfloat16 holds every e4m3 value) and scales each
block's float32 sum, where the torch path multiplies the dequantized tensors in float32: the two
differ by float rounding, bounded here by a few float32 ulps of the sum of |x| * |w| per output.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.fixtures.quantized_maker import ensure_quantized
from conveyor.worker.layers.quantization import fp8_kernel
from conveyor.worker.layers.quantization.activations import fake_quantize, quantize_activations
from conveyor.worker.layers.quantization.fp8_kernel import FP8Panels, load_fp8_gemm
from conveyor.worker.loader import load_model

pytestmark = pytest.mark.skipif(
    load_fp8_gemm() is None, reason="the FP8 kernel needs a C compiler and a host with AVX512-BF16"
)


@pytest.fixture(params=["tile", "amx"])
def path(request):
    """Each path of the kernel: "tile" the VDPBF16PS register tile at every row count, "amx"
    AMX tiles from 8 rows where the host has AMX (the tile below that)."""
    gemm = load_fp8_gemm()
    wanted = gemm.amx
    if request.param == "amx" and not wanted:
        pytest.skip("the AMX path needs a host with AMX-BF16 and Linux's grant of the tile state")
    gemm.set_amx(request.param == "amx")
    yield request.param
    gemm.set_amx(wanted)


@pytest.mark.parametrize(
    ("rows", "out_features", "in_features", "block", "strategy"),
    [
        (1, 64, 128, 128, "token"),
        (3, 100, 256, 128, "group"),
        (7, 300, 256, 256, "tensor"),
        (97, 70, 384, 128, "group"),
        (200, 130, 512, 512, "token"),
        (16, 64, 64, 32, "group"),
        (33, 50, 96, 96, "tensor"),
        (2, 17, 18, 18, "token"),  # a row shorter than a vector
    ],
)
def test_kernel_matches_the_torch_path(path, rows, out_features, in_features, block, strategy):
    generator = torch.Generator().manual_seed(rows + in_features)
    codes = (torch.randn(out_features, in_features, generator=generator) * 3).to(
        torch.float8_e4m3fn
    )
    scales = torch.rand(out_features, in_features // block, generator=generator) * 0.01 + 1e-3
    group = block if strategy == "group" else 0
    panels = FP8Panels(load_fp8_gemm(), codes, scales, block, strategy)
    weight = codes.float() * scales.repeat_interleave(block, dim=1)
    assert torch.equal(panels.dequantized(), weight)
    x = torch.randn(rows, in_features, generator=generator) * 3
    x[0, : in_features // 2] = 0.0
    bias = torch.randn(out_features, generator=generator)
    quantized = fake_quantize(x, "float8", strategy, group)
    bound = (quantized.abs() @ weight.abs().T) * (in_features * 2**-22) + 1e-6
    for b in (None, bias):
        expected = quantized @ weight.T + (0 if b is None else b)
        assert bool(((panels.linear(x, b) - expected).abs() <= bound).all())
    # A leading dimension and bfloat16 activations (rounded to float32 first, as the torch path).
    assert torch.equal(panels.linear(x.unsqueeze(0), None)[0], panels.linear(x, None))
    assert panels.linear(x.bfloat16(), None).dtype == torch.bfloat16


@pytest.mark.parametrize("strategy", ["token", "tensor", "group"])
def test_activations_round_code_for_code_as_the_torch_path(strategy):
    """The kernel rounds x to e4m3 itself: the same scales and codes as quantize_activations
    (the torch path's rounding, torch's own cast), over values that straddle every binade from
    e4m3's subnormals to its largest, ties included, and rows with zeros."""
    generator = torch.Generator().manual_seed(3)
    magnitudes = 2.0 ** torch.randint(-14, 9, (6, 256), generator=generator).float()
    x = torch.randn(6, 256, generator=generator) * magnitudes
    x[1, :64] = 0.0
    x[2] = 0.0
    x[3, :9] = torch.tensor([448.0, -448.0, 1.0625, 1.1875, -(2**-7), 2**-10, 3 * 2**-10, 5e-4, 0])
    block = 64 if strategy == "group" else 256
    codes, scales = load_fp8_gemm().quantize(x, strategy, block)
    expected_codes, expected_scales = quantize_activations(
        x, "float8", strategy, block if strategy == "group" else 0
    )
    assert torch.equal(codes, expected_codes)
    assert torch.equal(scales, expected_scales.expand_as(scales))


@pytest.mark.parametrize(
    ("kind", "options"),
    [("fp8", {}), ("compressed-tensors", dict(preset="FP8_DYNAMIC", group=0))],
    ids=["fp8-block", "FP8_DYNAMIC"],
)
def test_fp8_checkpoints_with_dynamic_activations_run_in_the_kernel(tiny_model_dirs, kind, options):
    """Qwen3-FP8's block-wise layout and per-channel FP8 with per-token activations go to the
    kernel, the checkpoint layout released; static activation scales (compressed-tensors FP8)
    keep the torch path."""
    from benchmarks.fixtures.model_maker import ensure_model

    source = ensure_model("small", "qwen3") if kind == "fp8" else tiny_model_dirs["qwen3"]
    model = load_model(ensure_quantized(source, kind, **options), torch.float32, "cpu")
    quant = model.model.layers[0].mlp.down_proj.quant
    assert quant.fp8 is not None and "codes" not in quant._parameters
    static = ensure_quantized(tiny_model_dirs["qwen3"], "compressed-tensors", preset="FP8", group=0)
    assert load_model(static, torch.float32, "cpu").model.layers[0].mlp.down_proj.quant.fp8 is None


def test_the_switch_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv("CONVEYOR_CPU_FP8_KERNEL", "0")
    fp8_kernel.load_fp8_gemm.cache_clear()
    try:
        assert fp8_kernel.load_fp8_gemm() is None
    finally:
        monkeypatch.undo()
        fp8_kernel.load_fp8_gemm.cache_clear()
    assert fp8_kernel.load_fp8_gemm() is not None


def test_amx_rows_do_not_depend_on_their_company():
    gemm = load_fp8_gemm()
    if not gemm.amx:
        pytest.skip("the AMX path needs a host with AMX-BF16 and Linux's grant of the tile state")
    generator = torch.Generator().manual_seed(11)
    codes = torch.randn(200, 256, generator=generator).to(torch.float8_e4m3fn)
    panels = FP8Panels(gemm, codes, torch.rand(200, 2, generator=generator), 128, "group")
    x = torch.randn(100, 256, generator=generator)
    whole = panels.linear(x, None)
    for start, stop in [(0, 8), (3, 20), (40, 72), (50, 100)]:
        assert torch.equal(panels.linear(x[start:stop], None), whole[start:stop]), (start, stop)
