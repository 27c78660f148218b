"""Weight-only int8 linears (worker/layers/int8_linear.py, csrc/int8_gemm.c) against torch.

The reference is torch's float32 ``x @ (q * scale)^T + bias`` on the same int8 weight. The kernel
sums x * q and scales once, so the two differ by float rounding: the bound below is a few
float32 ulps of the sum of |x| * |w| per output.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conveyor.worker.layers import int8_linear
from conveyor.worker.layers.int8_linear import (
    Int8Weight,
    W8A8Weight,
    load_int8_gemm,
    quantize_int8,
    quantize_model,
)
from conveyor.worker.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from conveyor.worker.layers.quantization.activations import quantize_activations

pytestmark = pytest.mark.skipif(load_int8_gemm() is None, reason="no C compiler for the kernel")


def _close(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias=None) -> None:
    reference = x.float() @ weight.T + (0 if bias is None else bias)
    bound = (x.float().abs() @ weight.abs().T) * (x.shape[-1] * 2**-23) + 1e-6
    error = (out.float() - reference).abs()
    assert bool((error <= bound).all()), f"max error {error.max():.3g}, bound {bound.min():.3g}"


def test_quantize_int8_rounds_each_row_to_its_own_scale():
    weight = torch.tensor([[0.5, -1.27, 0.01], [0.0, 0.0, 0.0], [254.0, 1.0, -127.0]])
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    torch.testing.assert_close(scale, torch.tensor([0.01, 0.0, 2.0]))
    # Row 3: 1 / 2 and -127 / 2 are halves, rounded to even (0, -64) as torch.round does.
    assert q.tolist() == [[50, -127, 1], [0, 0, 0], [127, 0, -64]]
    dequantized = q.float() * scale[:, None]
    assert bool(((dequantized - weight).abs() <= scale[:, None] / 2 + 1e-7).all())


def test_quantize_int8_never_leaves_the_symmetric_range():
    weight = torch.randn(64, 300, generator=torch.Generator().manual_seed(0)) * 3
    q, scale = quantize_int8(weight)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    assert bool((q.abs().amax(dim=1) == 127).all())  # each row's largest reaches 127


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 96, 97, 250])
@pytest.mark.parametrize(("in_features", "out_features"), [(1, 1), (17, 15), (300, 130), (64, 64)])
def test_kernel_matches_torch_on_the_same_int8_weight(rows, in_features, out_features):
    generator = torch.Generator().manual_seed(rows * 1000 + in_features)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.1
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator)
    for with_bias in (False, True):
        int8 = Int8Weight(weight, bias if with_bias else None)
        assert int8.gemm is not None
        dequantized = int8.dequantized()
        torch.testing.assert_close(
            dequantized, quantize_int8(weight)[0].float() * quantize_int8(weight)[1][:, None]
        )
        out = int8.linear(x)
        assert out.shape == (rows, out_features) and out.dtype == torch.float32
        _close(out, x, dequantized, bias if with_bias else None)


def test_the_kernel_widens_with_vector_instructions_where_the_cpu_has_avx2():
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    gemm = load_int8_gemm()
    assert gemm is not None
    assert gemm.vector_widening == (" avx2 " in f" {flags} ".replace("\n", " ")), gemm.path


def test_a_wrong_input_width_is_refused_by_name():
    int8 = Int8Weight(torch.randn(70, 33), None)
    with pytest.raises(ValueError, match="input has 1 features, the layer takes 33"):
        int8.linear(torch.randn(66, 1))


def test_kernel_reads_strided_rows_and_leading_dimensions():
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 80, generator=generator)
    int8 = Int8Weight(weight, None)
    wide = torch.randn(40, 200, generator=generator)
    x = wide[:, 16:96]  # rows 200 apart, as a slice of a fused projection's output
    assert x.stride(0) == 200
    _close(int8.linear(x), x, int8.dequantized())
    batched = torch.randn(3, 5, 80, generator=generator)
    out = int8.linear(batched)
    assert out.shape == (3, 5, 96)
    _close(out.view(15, 96), batched.view(15, 80), int8.dequantized())


def test_results_do_not_depend_on_the_thread_count():
    generator = torch.Generator().manual_seed(4)
    int8 = Int8Weight(torch.randn(512, 256, generator=generator), None)
    x = torch.randn(200, 256, generator=generator)  # three row blocks of 96 (the last partial)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = int8.linear(x)
        torch.set_num_threads(2)
        two = int8.linear(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_bfloat16_activations_compute_in_float32_and_return_bfloat16():
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(64, 128, generator=generator).bfloat16()
    int8 = Int8Weight(weight, None)
    x = torch.randn(9, 128, generator=generator).bfloat16()
    out = int8.linear(x)
    assert out.dtype == torch.bfloat16
    expected = (x.float() @ int8.dequantized().T).bfloat16()
    torch.testing.assert_close(out, expected, atol=0, rtol=2**-7)


def test_without_the_kernel_torch_widens_the_weight_to_the_same_result(monkeypatch):
    generator = torch.Generator().manual_seed(6)
    weight, bias = torch.randn(48, 72, generator=generator), torch.randn(48, generator=generator)
    x = torch.randn(11, 72, generator=generator)
    with_kernel = Int8Weight(weight, bias)
    monkeypatch.setattr(int8_linear, "load_int8_gemm", lambda: None)
    fallback = Int8Weight(weight, bias)
    assert fallback.gemm is None and fallback.q.shape == (48, 72)
    torch.testing.assert_close(fallback.dequantized(), with_kernel.dequantized())
    _close(fallback.linear(x), x, fallback.dequantized(), bias)
    torch.testing.assert_close(fallback.linear(x), with_kernel.linear(x))


def _filled(layer: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    for param in layer.parameters():
        param.data.copy_(torch.randn(param.shape, generator=generator))
    layer.process_weights_after_loading()
    return layer


def test_a_quantized_layer_computes_with_int8_and_drops_its_float_weight():
    layer = _filled(QKVParallelLinear(64, 16, 4, 2, bias=True), seed=7)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    x = torch.randn(6, 64)
    layer.quantize_int8()
    assert layer.weight.device.type == "meta" and layer.weight.shape == weight.shape
    assert layer.packed_weight is None and layer.int8 is not None
    q, scale = quantize_int8(weight)
    _close(layer(x), x, q.float() * scale[:, None], bias)
    with pytest.raises(ValueError, match="cannot load new weights"):
        layer.weight.weight_loader(layer.weight, weight, "q")  # type: ignore[attr-defined]
    int8 = layer.int8
    layer.quantize_int8()  # again: nothing changes
    assert layer.int8 is int8


def test_row_parallel_adds_its_bias_on_rank_zero_only():
    x = torch.randn(3, 32)
    outputs = []
    for rank in (0, 1):
        layer = _filled(RowParallelLinear(64, 16, bias=True, tp_rank=rank, tp_size=2), seed=8)
        layer.all_reduce = lambda partial: partial  # one rank's own partial sum
        layer.quantize_int8()
        outputs.append((layer(x), layer.int8.dequantized(), layer.bias))
    (out0, w0, bias0), (out1, w1, _) = outputs
    _close(out0, x, w0, bias0)
    _close(out1, x, w1)


def test_quantize_model_takes_the_decoder_linears_and_leaves_routers():
    model = torch.nn.ModuleDict(
        {
            "gate_up": _filled(MergedColumnParallelLinear(32, [48, 48]), seed=9),
            "down": _filled(RowParallelLinear(48, 32), seed=10),
            "column": _filled(ColumnParallelLinear(32, 8), seed=11),
            "router": _filled(ReplicatedLinear(32, 4, False, 0, 1), seed=12),
        }
    )
    quantize_model(model, "int8")
    assert all(model[name].int8 is not None for name in ("gate_up", "down", "column"))
    assert model["router"].int8 is None and model["router"].weight.device.type == "cpu"
    with pytest.raises(ValueError, match="quantizes to int8, not 'int4'"):
        quantize_model(model, "int4")


def test_load_model_quantizes_the_decoder_linears_before_packing(tiny_model_dirs):
    from conveyor.worker.layers.embedding import ParallelLMHead
    from conveyor.worker.loader import ModelLoadError, load_model

    model = load_model(tiny_model_dirs["qwen2"], torch.float32, "cpu", quantization="int8")
    linears = [
        m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
    ]
    assert len(linears) == 4 * model.config.num_hidden_layers
    for layer in linears:
        assert layer.int8 is not None and layer.packed_weight is None
        assert layer.weight.device.type == "meta"
    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    assert heads and all(h.weight.device.type == "cpu" for h in heads)
    # The head's logits read an int8 copy (the float weight stays for a tied embedding).
    for head in heads:
        assert isinstance(head.quantized, Int8Weight) and head.packed_weight is None
        hidden = torch.randn(3, head.weight.shape[1])
        _close(head(hidden)[:, : head.weight.shape[0]], hidden, head.quantized.dequantized())
    with pytest.raises(ModelLoadError, match="runs on CPU only"):
        load_model(tiny_model_dirs["qwen2"], torch.float32, "cuda", quantization="int8")


def _random_experts(kind: str) -> torch.nn.Module:
    from conveyor.worker.layers.fused_moe import MoEExperts
    from conveyor.worker.models.gpt_oss import GptOssExperts

    if kind == "gpt_oss":  # biases on both matrices, the clamped SwiGLU
        experts = GptOssExperts(4, 32, 24, swiglu_limit=7.0)
    else:
        experts = MoEExperts(4, 32, 24)
    generator = torch.Generator().manual_seed(13)
    for param in experts.parameters():
        param.data.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return experts


@pytest.mark.parametrize("kind", ["swiglu", "gpt_oss"])
def test_int8_experts_compute_what_their_dequantized_weights_do(kind):
    quantized, dequantized = _random_experts(kind), _random_experts(kind)
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            stacked = getattr(dequantized, name)
            for e in range(stacked.shape[0]):
                q, scale = quantize_int8(stacked[e])
                stacked[e] = q.float() * scale[:, None]
    quantized.quantize_int8()
    quantized.process_weights_after_loading()  # nothing to pack any more
    assert quantized.packed_weights is None and quantized.gate_up_proj.device.type == "meta"
    hidden = torch.randn(9, 32, generator=torch.Generator().manual_seed(14))
    expert_ids = torch.tensor([[e % 4, (e + 1) % 4] for e in range(9)])
    weights = torch.full((9, 2), 0.5)
    ours, theirs = quantized(hidden, expert_ids, weights), dequantized(hidden, expert_ids, weights)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert (ours - _random_experts(kind)(hidden, expert_ids, weights)).abs().max() > 1e-4
    with pytest.raises(ValueError, match="cannot load new weights"):
        quantized.weight_loader(quantized.down_proj, torch.zeros(32, 24), (0, "down"))


W8A8_REASON = "the W8A8 path needs a host with AVX-512 VNNI"


@pytest.mark.skipif(not (load_int8_gemm() and load_int8_gemm().w8a8), reason=W8A8_REASON)
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features", "per_tensor"),
    [(1, 64, 64, False), (3, 100, 130, False), (7, 300, 1024, True), (97, 70, 257, False),
     (200, 130, 96, True), (1, 17, 5, False)],
)  # fmt: skip
def test_w8a8_rounds_x_as_the_torch_path_and_multiplies_integers(
    rows, out_features, in_features, per_tensor
):
    """The kernel's activation codes are the torch path's (``quantize_activations``: scale
    max |x| / 127.5, round half to even, clamp): its output is the exact integer product of those
    codes with q, times both scales, within the float rounding of that last product (a code one
    step off would move an output by x_scale * |q| * w_scale, far outside the bound)."""
    generator = torch.Generator().manual_seed(rows * 7 + in_features)
    q = torch.randint(-127, 128, (out_features, in_features), generator=generator)
    q = q.to(torch.int8)
    scale = torch.rand(out_features, generator=generator) * 0.01 + 1e-4
    weight = W8A8Weight(load_int8_gemm(), q, scale, per_tensor)
    assert torch.equal(weight.dequantized(), q.float() * scale[:, None])
    x = torch.randn(rows, in_features, generator=generator) * 3
    x[0, : in_features // 2] = 0.0
    if rows > 2:
        x[2] = 0.0  # a row of zeros: the epsilon scale, zero codes
    bias = torch.randn(out_features, generator=generator)
    codes, x_scale = quantize_activations(x, "int", "tensor" if per_tensor else "token")
    exact = (codes.double() @ q.double().T) * x_scale.double() * scale.double()
    for b in (None, bias):
        out = weight.linear(x, b)
        expected = exact + (0 if b is None else b.double())
        bound = 4 * 2**-24 * (exact.abs() + (0 if b is None else b.double().abs())) + 1e-12
        assert bool(((out.double() - expected).abs() <= bound).all())
    # Strided rows and a leading dimension read the same.
    wide = torch.zeros(rows, in_features + 3)
    wide[:, :in_features] = x
    assert torch.equal(
        weight.linear(wide[:, :in_features].unsqueeze(0), None)[0], weight.linear(x, None)
    )


@pytest.mark.skipif(not (load_int8_gemm() and load_int8_gemm().w8a8), reason=W8A8_REASON)
def test_w8a8_results_do_not_depend_on_the_thread_count_or_company():
    generator = torch.Generator().manual_seed(9)
    q = torch.randint(-127, 128, (512, 256), generator=generator).to(torch.int8)
    weight = W8A8Weight(load_int8_gemm(), q, torch.rand(512, generator=generator), False)
    x = torch.randn(200, 256, generator=generator)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = weight.linear(x, None)
        torch.set_num_threads(2)
        two = weight.linear(x, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(weight.linear(x[5:6], None), one[5:6])  # per-token scales: rows alone


@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features", "group_size"),
    [(1, 64, 64, 32), (5, 100, 256, 128), (7, 130, 96, 96), (200, 70, 384, 64)],
)
def test_grouped_weights_compute_what_their_groups_mean(
    rows, out_features, in_features, group_size, zero_points
):
    """Group-wise 8-bit (GPTQ 8-bit, W8A16 with groups): (q - zero) * scale per group, each
    group summed then scaled in the kernel; the same as torch on the dequantized weight up to
    float rounding, whatever the thread count."""
    generator = torch.Generator().manual_seed(rows + in_features)
    q = torch.randint(-128, 128, (out_features, in_features), generator=generator).to(torch.int8)
    groups = in_features // group_size
    scales = torch.rand(out_features, groups, generator=generator) * 0.02 + 1e-3
    zeros = None
    if zero_points:
        zeros = torch.randint(-20, 21, (out_features, groups), generator=generator).float()
    weight = Int8Weight.from_grouped(q, scales, zeros, group_size)
    index = torch.arange(in_features) // group_size
    expected = (q.float() - (0 if zeros is None else zeros[:, index])) * scales[:, index]
    assert torch.equal(weight.dequantized(), expected)
    x = torch.randn(rows, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    _close(weight.linear(x, with_bias=False), x, expected)
    _close(weight.linear(x, with_bias=False, add=bias), x, expected, bias)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = weight.linear(x, with_bias=False)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, weight.linear(x, with_bias=False))


def test_grouped_weights_are_refused_where_groups_do_not_divide_the_row():
    q = torch.zeros(8, 96, dtype=torch.int8)
    assert Int8Weight.from_grouped(q, torch.ones(8, 2), None, 64) is None
