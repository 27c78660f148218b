"""The compiled CPU token ops (worker/layers/cpu_ops.py) against the torch ops they replace.

Fails, rather than skips, where a C compiler exists and the library does not build: the layers
would silently fall back to the slower torch path.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from conveyor.worker import native
from conveyor.worker.layers import cpu_ops
from conveyor.worker.layers.cpu_ops import TokenOps, load_token_ops
from conveyor.worker.layers.norm import RMSNorm, rms_normalize
from conveyor.worker.layers.rotary import RotaryAngles, rotate_
from tests.env_switches import assert_refused, switch_set

EPS = 1e-6


def torch_add_rms_norm(x, residual, weight):
    summed = x if residual is None else x + residual
    return rms_normalize(summed, weight, EPS), summed


@pytest.fixture(scope="module")
def ops() -> TokenOps:
    if native.compiled_paths_disabled():
        pytest.skip("CONVEYOR_CPU_KERNEL=0 is set")
    if native.find_compiler() is None:
        pytest.skip("no C compiler on this machine")
    loaded = load_token_ops()
    assert loaded is not None, "a compiler exists but the token ops did not build"
    return loaded


@pytest.mark.parametrize("size", [8, 40, 64, 512, 1000, 2048, 4099])
@pytest.mark.parametrize("num_rows", [0, 1, 3, 64, 700])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "alone"])
def test_add_rms_norm_equals_the_torch_ops(ops, size, num_rows, with_residual):
    generator = torch.Generator().manual_seed(size * 1000 + num_rows)
    x = torch.randn(num_rows, size, generator=generator) * 3
    residual = torch.randn(num_rows, size, generator=generator) if with_residual else None
    weight = torch.randn(size, generator=generator)
    before = [x.clone(), None if residual is None else residual.clone()]
    normed, summed = ops.add_rms_norm(x, residual, weight, EPS)
    expected_normed, expected_summed = torch_add_rms_norm(x, residual, weight)
    torch.testing.assert_close(normed, expected_normed, rtol=2e-6, atol=2e-6)
    if with_residual:
        assert torch.equal(summed, expected_summed)  # one float addition: exact
    else:
        assert summed is None
    # Fresh outputs; the inputs are as they were.
    assert torch.equal(x, before[0])
    assert residual is None or torch.equal(residual, before[1])


def test_rows_of_a_wider_tensor_are_read_through_their_stride(ops):
    wide = torch.randn(33, 3 * 256)
    x, residual = wide[:, 256:512], wide[:, :256]
    assert not x.is_contiguous() and TokenOps.supports(x, torch.ones(256), residual)
    weight = torch.rand(256) + 0.5
    normed, summed = ops.add_rms_norm(x, residual, weight, EPS)
    expected_normed, expected_summed = torch_add_rms_norm(x, residual, weight)
    torch.testing.assert_close(normed, expected_normed, rtol=2e-6, atol=2e-6)
    assert torch.equal(summed, expected_summed)


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bfloat16 steps apart two same-signed bfloat16 tensors are, element-wise."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("size", [8, 64, 512, 2048])
@pytest.mark.parametrize("num_rows", [0, 1, 64, 700])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "alone"])
def test_bfloat16_rounds_where_the_torch_ops_round(ops, size, num_rows, with_residual):
    """The sum is exact (one bfloat16 add); the norm, computed in float32 by both, may differ in
    its last float32 bit and so, rarely, by a bfloat16 step before the weight's multiply, which
    rounds again: at most two steps apart, almost always none."""
    generator = torch.Generator().manual_seed(size + num_rows)
    x = (torch.randn(num_rows, size, generator=generator) * 3).bfloat16()
    residual = (
        torch.randn(num_rows, size, generator=generator).bfloat16() if with_residual else None
    )
    weight = torch.randn(size, generator=generator).bfloat16()
    normed, summed = ops.add_rms_norm(x, residual, weight, EPS)
    expected_normed, expected_summed = torch_add_rms_norm(x, residual, weight)
    assert normed.dtype == torch.bfloat16
    if with_residual:
        assert torch.equal(summed, expected_summed)
    ulps = bf16_ulps(normed, expected_normed)
    assert ulps.numel() == 0 or (ulps.max() <= 2 and (ulps == 0).float().mean() > 0.99), (
        ulps.max(),
        (ulps == 0).float().mean(),
    )


def test_what_the_op_does_not_take_goes_to_torch():
    x = torch.randn(4, 64)
    assert TokenOps.supports(x, torch.ones(64), None)
    assert not TokenOps.supports(x.double(), torch.ones(64, dtype=torch.float64), None)
    assert not TokenOps.supports(x.t(), torch.ones(4), None)  # columns not dense
    assert not TokenOps.supports(x.view(4, 2, 32), torch.ones(32), None)  # per-head norms
    assert not TokenOps.supports(x, torch.ones(64), torch.randn(4, 32))
    assert TokenOps.supports(x.bfloat16(), torch.ones(64, dtype=torch.bfloat16), None)
    assert not TokenOps.supports(x.bfloat16(), torch.ones(64), None)  # mixed dtypes
    assert not TokenOps.supports(x, torch.ones(64), torch.randn(4, 64).bfloat16())
    assert not TokenOps.supports(x.half(), torch.ones(64, dtype=torch.half), None)
    odd = torch.randn(4, 60).bfloat16()  # bfloat16 rows go 8 at a time
    assert not TokenOps.supports(odd, torch.ones(60, dtype=torch.bfloat16), None)


def test_rows_wider_or_narrower_than_the_weight_are_refused_not_read_past(ops):
    norm = RMSNorm(64, EPS)
    with pytest.raises(RuntimeError):
        norm(torch.randn(3, 32), torch.randn(3, 32))


def test_the_layer_takes_the_compiled_op_and_gives_the_torch_result(ops, monkeypatch):
    norm = RMSNorm(96, EPS)
    norm.weight.data = torch.rand(96) + 0.5
    x, residual = torch.randn(10, 96), torch.randn(10, 96)
    calls = []
    original = TokenOps.add_rms_norm

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(TokenOps, "add_rms_norm", counting)
    compiled = norm(x, residual)
    alone = norm(x)
    assert len(calls) == 2
    half = RMSNorm(96, EPS).bfloat16()
    half.weight.data = norm.weight.data.bfloat16()
    assert half(x.bfloat16(), residual.bfloat16())[0].dtype == torch.bfloat16
    assert len(calls) == 3
    # With the library unavailable (no compiler, CONVEYOR_CPU_KERNEL=0) the torch ops run.
    monkeypatch.setattr("conveyor.worker.layers.norm.load_token_ops", lambda: None)
    fallback = norm(x, residual)
    torch.testing.assert_close(compiled[0], fallback[0], rtol=2e-6, atol=2e-6)
    assert torch.equal(compiled[1], fallback[1])
    torch.testing.assert_close(alone, norm(x), rtol=2e-6, atol=2e-6)
    assert len(calls) == 3


@pytest.mark.parametrize("flags", [("-O3", "-fopenmp"), ("-O2",)], ids=["portable", "plain"])
def test_fallback_builds_compute_the_same(tmp_path, monkeypatch, flags):
    # What a compiler that refuses -march=native or OpenMP builds must still be right.
    compiler = native.find_compiler()
    if compiler is None:
        pytest.skip("no C compiler on this machine")
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path))
    path = native.build(compiler, flags, cpu_ops.SOURCE_PATH, cpu_ops._inputs())
    ops = cpu_ops._from_library(ctypes.CDLL(str(path)), path)
    x, residual, weight = torch.randn(300, 520), torch.randn(300, 520), torch.randn(520)
    normed, summed = ops.add_rms_norm(x, residual, weight, EPS)
    expected_normed, expected_summed = torch_add_rms_norm(x, residual, weight)
    torch.testing.assert_close(normed, expected_normed, rtol=2e-6, atol=2e-6)
    assert torch.equal(summed, expected_summed)
    # The other two ops in the same builds.
    qkv = torch.randn(37, 16 * 64)
    expected = hf_qk_norm_rope(qkv[:, : 12 * 64].view(37, 12, 64), *norm_and_angles(37, 12, 64, 32))
    got = ops.qk_norm_rope_(qkv[:, : 12 * 64].view(37, 12, 64), *norm_and_angles(37, 12, 64, 32))
    assert torch.equal(got, expected)
    gated = torch.randn(70, 2 * 100) * 4
    expected = torch.nn.functional.silu(gated[:, :100]) * gated[:, 100:]
    torch.testing.assert_close(ops.silu_and_mul(gated), expected, rtol=1e-6, atol=1e-6)
    generator = torch.Generator().manual_seed(37)
    x, weight = torch.randn(2, 100, generator=generator), torch.randn(37, 100, generator=generator)
    error = (ops.small_linear(x, weight, None).double() - float64_linear(x, weight, None)).abs()
    assert (error <= float32_sum_bound(x, weight, None)).all(), error.max()
    assert ops.threaded == ("-fopenmp" in flags)
    # And the bfloat16 forms, against the native build's: the same roundings, so the same bits
    # but where a float32 result differing in its last bit (sums in another order, multiply-adds
    # fused or not) lands on the other side of a bfloat16 rounding.
    native_ops = load_token_ops()
    if native_ops is not None:
        generator = torch.Generator().manual_seed(5)
        rows = (torch.randn(300, 520, generator=generator) * 3).bfloat16()
        added = torch.randn(300, 520, generator=generator).bfloat16()
        scale = torch.randn(520, generator=generator).bfloat16()
        normed, summed = ops.add_rms_norm(rows, added, scale, EPS)
        assert torch.equal(summed, native_ops.add_rms_norm(rows, added, scale, EPS)[1])
        assert_nearly_equal_bf16(normed, native_ops.add_rms_norm(rows, added, scale, EPS)[0])
        gated = (torch.randn(70, 2 * 100, generator=generator) * 4).bfloat16()
        assert_nearly_equal_bf16(ops.silu_and_mul(gated), native_ops.silu_and_mul(gated))
        heads = (torch.randn(37, 12, 64, generator=generator) * 3).bfloat16()
        weight, _, cos, sin = norm_and_angles(37, 12, 64, 32)
        weight, cos, sin = weight.bfloat16(), cos.bfloat16(), sin.bfloat16()
        got = ops.qk_norm_rope_(heads.clone(), weight, EPS, cos, sin)
        assert_nearly_equal_bf16(
            got, native_ops.qk_norm_rope_(heads.clone(), weight, EPS, cos, sin)
        )


def assert_nearly_equal_bf16(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal but for under 0.1 % of the values, each within two bfloat16 steps of the largest
    value of its row (a step before a cancelling sum is many steps of its result)."""
    assert (got != expected).float().mean() < 1e-3
    error = (got.float() - expected.float()).abs()
    largest = expected.float().abs().amax(dim=-1, keepdim=True).expand_as(error)
    assert (error <= largest * 2**-7).all(), (error / largest).max()


def norm_and_angles(num_tokens, num_heads, head_dim, half, seed=0):
    """A per-head norm weight, eps, and cos / sin [T, 1, half] as RotaryAngles holds them (views
    of one [T, 2 * half] lookup)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.rand(num_heads, head_dim, generator=generator) + 0.5
    positions = torch.randint(0, 4096, (num_tokens,), generator=generator).float()
    inv_freq = 1.0 / (10000 ** (torch.arange(half).float() / half))
    freqs = positions[:, None] * inv_freq[None, :]
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    cos, sin = table.chunk(2, dim=-1)
    return weight, EPS, cos.unsqueeze(1), sin.unsqueeze(1)


def hf_qk_norm_rope(x, weight, eps, cos, sin):
    """Hugging Face's float32 ops: RMSNorm (normalise, then scale), then q * cos +
    rotate_half(q) * sin over the first 2 * half dims of each head."""
    if weight is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    half = cos.shape[-1]
    rotated = x.clone()
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    cos2, sin2 = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    rotated[..., : 2 * half] = x[..., : 2 * half] * cos2 + torch.cat([-x2, x1], -1) * sin2
    return rotated


@pytest.mark.parametrize(
    "head_dim,half", [(64, 32), (128, 64), (256, 128), (64, 16), (80, 40), (24, 12)]
)
@pytest.mark.parametrize("num_tokens", [1, 5, 64, 600])
@pytest.mark.parametrize("with_norm", [True, False], ids=["norm", "rope-only"])
def test_qk_norm_rope_equals_hugging_faces_ops_in_place_in_the_fused_projection(
    ops, head_dim, half, num_tokens, with_norm
):
    num_heads, num_kv_heads = 8, 2
    generator = torch.Generator().manual_seed(head_dim * 7 + num_tokens)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator)
    qkv *= 3
    qk_width = (num_heads + num_kv_heads) * head_dim
    weight, eps, cos, sin = norm_and_angles(num_tokens, num_heads + num_kv_heads, head_dim, half)
    weight = weight if with_norm else None
    before = qkv.clone()
    qk = qkv[:, :qk_width].view(num_tokens, -1, head_dim)  # strided: rows of the qkv output
    assert TokenOps.takes_heads(qk, weight, cos, sin)
    expected = hf_qk_norm_rope(qk.clone(), weight, eps, cos, sin)
    result = ops.qk_norm_rope_(qk, weight, eps, cos, sin)
    assert result.data_ptr() == qkv.data_ptr()  # in place
    assert torch.equal(qkv[:, qk_width:], before[:, qk_width:])  # the values are left alone
    if head_dim % 32 == 0 or not with_norm:
        # The sum of squares in torch's order, every product rounded as torch rounds it: the
        # same bits as Hugging Face's ops.
        assert torch.equal(qk, expected)
    else:  # other head dims: the tail of the sum of squares goes in another order
        torch.testing.assert_close(qk, expected, rtol=1e-6, atol=2e-6)


def test_qk_norm_rope_takes_only_what_it_can_read():
    x = torch.randn(4, 3, 64)
    weight, _, cos, sin = norm_and_angles(4, 3, 64, 32)
    assert TokenOps.takes_heads(x, weight, cos, sin) and TokenOps.takes_heads(x, None, cos, sin)
    assert not TokenOps.takes_heads(x.double(), weight, cos, sin)
    assert not TokenOps.takes_heads(x.bfloat16(), weight, cos, sin)  # one dtype for all
    assert TokenOps.takes_heads(
        x.bfloat16(), weight.bfloat16(), cos.bfloat16(), sin.bfloat16()
    ) and TokenOps.takes_heads(x.bfloat16(), None, cos.bfloat16(), sin.bfloat16())
    assert not TokenOps.takes_heads(x.double(), weight.double(), cos.double(), sin.double())
    assert not TokenOps.takes_heads(x.transpose(0, 1), weight, cos[:3], sin[:3])  # heads apart
    assert not TokenOps.takes_heads(x[..., ::2], weight[:, :32], cos, sin)  # dims apart
    assert not TokenOps.takes_heads(x, weight[:2], cos, sin)  # a weight per head
    assert not TokenOps.takes_heads(x, weight.t().contiguous().t(), cos, sin)  # dense weight
    assert not TokenOps.takes_heads(x, weight, cos[:3], sin[:3])  # an angle per token
    assert not TokenOps.takes_heads(x, weight, cos.bfloat16(), sin.bfloat16())
    wide = torch.randn(4, 1, 40)
    assert not TokenOps.takes_heads(x, weight, wide, wide)  # more rotated dims than a head
    assert not TokenOps.takes_heads(x, weight, cos, sin.contiguous())  # one stride for both
    assert not TokenOps.takes_heads(x[:0], weight, cos[:0], sin[:0])


@pytest.mark.parametrize("size", [1, 13, 64, 1536, 1000])
@pytest.mark.parametrize("num_rows", [0, 1, 7, 64, 300])
def test_silu_and_mul_is_within_a_few_roundings_of_torchs(ops, size, num_rows):
    generator = torch.Generator().manual_seed(size + 31 * num_rows)
    x = torch.randn(num_rows, 2 * size, generator=generator) * 6
    before = x.clone()
    out = ops.silu_and_mul(x)
    expected = torch.nn.functional.silu(x[:, :size]) * x[:, size:]
    assert out.shape == (num_rows, size) and out.is_contiguous()
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(x, before)


def test_silu_and_mul_over_the_whole_float_range():
    ops = load_token_ops()
    if ops is None:
        pytest.skip("no compiled token ops here")
    g = torch.cat([torch.linspace(-120, 100, 20_001), torch.tensor([0.0, -0.0, 1e-30, -1e-30])])
    out = ops.silu_and_mul(torch.cat([g, torch.ones_like(g)]).view(1, -1))[0]
    expected = torch.nn.functional.silu(g)
    assert torch.isfinite(out).all()
    # Below g = -87 the op gives 0 where torch gives g * e^g, under 1.5e-36.
    torch.testing.assert_close(out, expected, rtol=5e-7, atol=1.5e-36)
    assert torch.equal(out[g < -87], torch.zeros_like(out[g < -87]))
    rows = torch.randn(5, 2 * 64)
    strided = torch.cat([rows, torch.randn(5, 30)], 1)[:, : 2 * 64]  # rows of a wider tensor
    torch.testing.assert_close(ops.silu_and_mul(strided), ops.silu_and_mul(rows), rtol=0, atol=0)


def test_the_layers_take_the_compiled_ops_and_fall_back_to_torch(ops, monkeypatch):
    from conveyor.worker.layers.activation import SiluAndMul

    x = torch.randn(9, 2 * 48)
    compiled = SiluAndMul()(x)
    monkeypatch.setattr("conveyor.worker.layers.activation.load_token_ops", lambda: None)
    fallback = SiluAndMul()(x)
    torch.testing.assert_close(compiled, fallback, rtol=1e-6, atol=1e-6)
    assert TokenOps.takes_gated(x.bfloat16()) and not TokenOps.takes_gated(x[:, :95])
    assert not TokenOps.takes_gated(x.double()) and not TokenOps.takes_gated(x.half())
    assert not TokenOps.takes_gated(x.t())


def float64_linear(x, weight, bias):
    y = x.double() @ weight.double().T
    return y if bias is None else y + bias.double()


def float32_sum_bound(x, weight, bias):
    """The classic bound on a float32 dot product plus bias summed in any order: gamma_n times
    the sum of the terms' magnitudes, n the number of terms, gamma_n = n u / (1 - n u)."""
    terms = x.shape[1] + (bias is not None)
    unit = 2.0**-24
    gamma = terms * unit / (1 - terms * unit)
    magnitude = x.double().abs() @ weight.double().abs().T
    return gamma * (magnitude if bias is None else magnitude + bias.double().abs())


# Output counts below, at and past a group of 8 and the 2-thread split; input sizes that are and
# are not a whole number of 16- or 8-float vectors.
@pytest.mark.parametrize("out_features,in_features", [(1, 3), (7, 16), (13, 40), (1024, 512),
                                                      (517, 1536), (8192, 64)])  # fmt: skip
@pytest.mark.parametrize("num_rows", [1, 2, 3, 5, 7, 8])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_small_linear_is_the_float64_product_within_float32_roundings(
    ops, out_features, in_features, num_rows, with_bias
):
    generator = torch.Generator().manual_seed(out_features * 7 + in_features)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    # Rows of a wider tensor: read through their stride.
    x = torch.randn(num_rows, in_features + 5, generator=generator)[:, :in_features]
    assert TokenOps.takes_linear(x, weight, bias)
    got = ops.small_linear(x, weight, bias)
    assert got.shape == (num_rows, out_features) and got.dtype == torch.float32
    expected = float64_linear(x, weight, bias)
    # |error| <= in_features roundings of the running sum; the sums here are O(1).
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=in_features * 2e-7)


def test_small_linear_gives_each_row_the_same_bits_in_any_company_and_on_any_thread_count(ops):
    # Every output is summed in one order: a request's numbers do not depend on which requests
    # (or its own speculative positions) share its step, nor on how many threads ran it. 1,003
    # outputs: the last three (or seven) go through the one-row-at-a-time loop, and where each
    # thread's run starts moves with the count.
    weight, x = torch.randn(1003, 520), torch.randn(8, 520)
    alone = torch.cat([ops.small_linear(x[i : i + 1], weight, None) for i in range(8)])
    for rows in range(2, 9):
        assert torch.equal(ops.small_linear(x[:rows], weight, None), alone[:rows]), rows
    pair = alone[:2]
    for threads in (1, 2, 3, 16, 64):
        out = torch.empty(2, 1003)
        status = ops._small_linear(
            x.data_ptr(), x.stride(0), 2, weight.data_ptr(), 1003, 520, None,
            out.data_ptr(), 1003, threads,
        )  # fmt: skip
        assert status == 0 and torch.equal(out, pair), threads


def test_small_linear_takes_one_to_eight_dense_float32_rows_only():
    x, weight, bias = torch.randn(2, 64), torch.randn(32, 64), torch.randn(32)
    assert TokenOps.takes_linear(x, weight, bias) and TokenOps.takes_linear(x[:1], weight, None)
    assert TokenOps.takes_linear(torch.randn(8, 64), weight, bias)
    assert not TokenOps.takes_linear(torch.randn(9, 64), weight, bias)  # oneDNN's from 9 rows
    assert not TokenOps.takes_linear(x[:0], weight, bias)
    assert not TokenOps.takes_linear(x.bfloat16(), weight.bfloat16(), None)
    assert not TokenOps.takes_linear(torch.randn(64, 2).t(), weight, bias)  # columns not dense
    assert not TokenOps.takes_linear(x, torch.randn(64, 32).t(), bias)  # weight not dense
    assert not TokenOps.takes_linear(x, torch.randn(32, 63), bias)  # in sizes differ
    assert not TokenOps.takes_linear(x, weight, torch.randn(31))
    assert not TokenOps.takes_linear(x.view(2, 1, 64), weight, bias)
    assert not TokenOps.takes_linear(torch.randn(1, 0), torch.randn(32, 0), None)  # F.linear's
    # Autograd must see what a trainable weight did; with gradients off the kernel may run.
    trainable = torch.nn.Parameter(weight.clone())
    assert not TokenOps.takes_linear(x, trainable, bias)
    with torch.no_grad():
        assert TokenOps.takes_linear(x, trainable, bias)


def test_small_batches_take_the_small_linear_and_larger_ones_the_packed_weight(ops, monkeypatch):
    from conveyor.worker.layers.gemm import linear, pack_weight

    generator = torch.Generator().manual_seed(96)
    weight = torch.randn(96, 128, generator=generator)
    bias = torch.randn(96, generator=generator)
    packed = pack_weight(weight)
    calls = []
    original = TokenOps.small_linear

    def counting(self, *args):
        calls.append(args[0].shape[0])
        return original(self, *args)

    monkeypatch.setattr(TokenOps, "small_linear", counting)
    for num_rows in (1, 2, 8, 9, 64):
        x = torch.randn(num_rows, 128, generator=generator)
        error = (linear(x, weight, bias, packed).double() - float64_linear(x, weight, bias)).abs()
        # Any summation order of 129 float32 terms stays within 129 roundings of the sum of their
        # magnitudes (these sums reach ~40: a bound in absolute terms alone failed now and then).
        assert (error <= float32_sum_bound(x, weight, bias)).all(), error.max()
    assert calls == [1, 2, 8]
    # Three rows and more of a weight too large to stay in cache: the packed weight.
    from conveyor.worker.layers.gemm import SMALL_LINEAR_WIDE_MAX_ELEMENTS

    large = torch.randn(SMALL_LINEAR_WIDE_MAX_ELEMENTS // 128 + 1, 128, generator=generator)
    for num_rows in (2, 3):
        linear(torch.randn(num_rows, 128, generator=generator), large, None, pack_weight(large))
    assert calls == [1, 2, 8, 2]
    del calls[3:]
    # A build without OpenMP would stream on one thread: the packed weight serves two.
    monkeypatch.setattr(ops, "threaded", False)
    if torch.get_num_threads() > 1:
        linear(torch.randn(1, 128), weight, bias, packed)
        assert calls == [1, 2, 8]
    monkeypatch.setattr(ops, "threaded", True)
    # Without the library (no compiler, CONVEYOR_CPU_KERNEL=0) the packed weight serves them.
    monkeypatch.setattr("conveyor.worker.layers.gemm.load_token_ops", lambda: None)
    linear(torch.randn(1, 128), weight, bias, packed)
    assert calls == [1, 2, 8]


def test_conveyor_small_linear_off_keeps_the_packed_weight_and_other_values_are_refused(
    ops, monkeypatch
):
    from conveyor.worker.layers.gemm import linear, pack_weight

    generator = torch.Generator().manual_seed(40)
    weight = torch.randn(40, 64, generator=generator)
    calls = []
    original = TokenOps.small_linear
    monkeypatch.setattr(
        TokenOps, "small_linear", lambda self, *args: calls.append(1) or original(self, *args)
    )
    x = torch.randn(1, 64, generator=generator)
    with switch_set(monkeypatch, "CONVEYOR_SMALL_LINEAR", "off", cpu_ops.small_linear_enabled):
        error = (
            linear(x, weight, None, pack_weight(weight)).double() - x.double() @ weight.double().T
        )
        assert (error.abs() <= float32_sum_bound(x, weight, None)).all(), error.abs().max()
        assert calls == []
    assert_refused(monkeypatch, "CONVEYOR_SMALL_LINEAR", "sometimes", cpu_ops.small_linear_enabled)
    linear(x, weight, None, pack_weight(weight))
    assert calls == [1]


@pytest.mark.parametrize("size", [1, 13, 64, 1000, 1536])
@pytest.mark.parametrize("num_rows", [0, 1, 7, 64])
def test_bfloat16_silu_and_mul_rounds_where_the_torch_ops_round(ops, size, num_rows):
    """torch's bfloat16 silu computes in float32 and rounds, then the product rounds again: the
    op rounds at the same two places, so only a float32 exp a few ulps from torch's near a
    rounding boundary can move a result one bfloat16 step (none in these draws). Sizes off the
    vector width go through the padded tail."""
    generator = torch.Generator().manual_seed(size + 17 * num_rows)
    x = (torch.randn(num_rows, 2 * size, generator=generator) * 6).bfloat16()
    before = x.clone()
    out = ops.silu_and_mul(x)
    expected = torch.nn.functional.silu(x[:, :size]) * x[:, size:]
    assert out.dtype == torch.bfloat16 and out.shape == (num_rows, size)
    ulps = bf16_ulps(out, expected)
    assert ulps.numel() == 0 or (ulps.max() <= 1 and (ulps == 0).float().mean() > 0.999)
    assert torch.equal(x, before)


def test_bfloat16_silu_and_mul_over_the_whole_range(ops):
    g = torch.cat([torch.linspace(-120, 100, 20_001), torch.tensor([0.0, -0.0, 1e-30, -1e-30])])
    g = g.bfloat16()
    out = ops.silu_and_mul(torch.cat([g, torch.ones_like(g)]).view(1, -1))[0]
    expected = torch.nn.functional.silu(g)
    tiny = g.float() < -87  # the op's e^g is 0 there; torch's a subnormal under 1.5e-36
    assert torch.equal(out[tiny], torch.zeros_like(out[tiny]))
    assert bf16_ulps(out[~tiny], expected[~tiny]).max() <= 1


@pytest.mark.parametrize(
    "head_dim,half", [(64, 32), (128, 64), (256, 128), (64, 16), (80, 40), (24, 12)]
)
@pytest.mark.parametrize("num_tokens", [1, 5, 64, 300])
@pytest.mark.parametrize("with_norm", [True, False], ids=["norm", "rope-only"])
def test_bfloat16_qk_norm_rope_rounds_where_the_torch_ops_round(
    ops, head_dim, half, num_tokens, with_norm
):
    """Against the layer's own torch ops in bfloat16 (rms_normalize, then rotate_: what a
    bfloat16 model runs without the op, rounded as Hugging Face's). The rotation alone is bit
    for bit (each product of two bfloat16 values is exact in float32, and every op rounds where
    torch's does); the norm's float32 sum of squares goes in another order than torch's, which
    can move a value one bfloat16 step before the weight's multiply and the rotation round it
    again: rarely a difference, never more than a step or two of the head's largest value."""
    num_heads, num_kv_heads = 8, 2
    generator = torch.Generator().manual_seed(head_dim * 5 + num_tokens)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (torch.randn(num_tokens, width, generator=generator) * 3).bfloat16()
    qk_width = (num_heads + num_kv_heads) * head_dim
    weight, eps, cos, sin = norm_and_angles(num_tokens, num_heads + num_kv_heads, head_dim, half)
    weight, cos, sin = weight.bfloat16() if with_norm else None, cos.bfloat16(), sin.bfloat16()
    before = qkv.clone()
    qk = qkv[:, :qk_width].view(num_tokens, -1, head_dim)
    assert TokenOps.takes_heads(qk, weight, cos, sin)
    reference = qk.clone()
    if weight is not None:
        reference = rms_normalize(reference, weight, eps)
    expected = rotate_(reference, RotaryAngles(cos, sin))
    result = ops.qk_norm_rope_(qk, weight, eps, cos, sin)
    assert result.data_ptr() == qkv.data_ptr()
    assert torch.equal(qkv[:, qk_width:], before[:, qk_width:])
    if not with_norm:
        assert torch.equal(qk, expected)
    else:
        # A step of difference before the rotation stays a step of its inputs' size after it,
        # many steps of a result that cancels (x1 cos - x2 sin near 0): bound it by the head.
        assert_nearly_equal_bf16(qk, expected)


def test_the_bfloat16_layers_take_the_compiled_ops(ops, monkeypatch):
    """The layers route bfloat16 rows to the ops, and the torch ops they replace agree."""
    from conveyor.worker.layers import rotary
    from conveyor.worker.layers.activation import SiluAndMul

    x = (torch.randn(9, 2 * 48) * 4).bfloat16()
    heads = (torch.randn(9, 6, 64) * 3).bfloat16()
    weight, _, cos, sin = norm_and_angles(9, 6, 64, 32)
    weight, cos, sin = weight.bfloat16(), cos.bfloat16(), sin.bfloat16()
    calls = []
    for name in ("silu_and_mul", "qk_norm_rope_"):
        original = getattr(TokenOps, name)
        monkeypatch.setattr(
            TokenOps, name, lambda self, *a, _o=original, _n=name: calls.append(_n) or _o(self, *a)
        )
    compiled = SiluAndMul()(x)
    rotated = rotary.normalize_and_rotate(heads.clone(), weight, EPS, RotaryAngles(cos, sin))
    assert calls == ["silu_and_mul", "qk_norm_rope_"]
    monkeypatch.setattr("conveyor.worker.layers.activation.load_token_ops", lambda: None)
    monkeypatch.setattr("conveyor.worker.layers.rotary.load_token_ops", lambda: None)
    assert bf16_ulps(compiled, SiluAndMul()(x)).max() <= 1
    fallback = rotary.normalize_and_rotate(heads.clone(), weight, EPS, RotaryAngles(cos, sin))
    assert bf16_ulps(rotated, fallback).max() <= 2
