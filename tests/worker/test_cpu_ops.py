"""The compiled CPU token ops (worker/layers/cpu_ops.py) against the torch ops they replace.

Fails, rather than skips, where a C compiler exists and the library does not build: the layers
would silently fall back to the slower torch path.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from worker import native
from worker.layers import cpu_ops
from worker.layers.cpu_ops import TokenOps, load_token_ops
from worker.layers.norm import RMSNorm, rms_normalize

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
    monkeypatch.setattr("worker.layers.norm.load_token_ops", lambda: None)
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
