"""The Triton token ops (worker/layers/triton_ops.py) against the torch ops they replace on CUDA.

On the CPU they run under Triton's interpreter (TRITON_INTERPRET=1, set by tests/devices.py): the
same kernel source, each program executed with numpy; with CONVEYOR_TEST_DEVICE=cuda they are
compiled and run on the GPU. float32 and bfloat16: each kernel rounds where the torch ops round.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.worker.attention.triton_backend import triton_import_error
from conveyor.worker.layers import triton_ops
from conveyor.worker.layers.activation import SiluAndMul
from conveyor.worker.layers.norm import rms_normalize
from conveyor.worker.layers.rotary import RotaryAngles, rotate_
from tests.devices import TEST_DEVICE
from tests.env_switches import assert_refused, switch_set

pytestmark = [
    pytest.mark.gpu_kernel,
    pytest.mark.skipif(
        triton_import_error() is not None, reason=f"needs triton ({triton_import_error()})"
    ),
]
DEVICE = torch.device("cuda" if TEST_DEVICE == "cuda" else "cpu")

if triton_import_error() is None:
    import triton
    import triton.language as tl

    from conveyor.worker.layers.triton_token_kernels import _on_grid, _to

    @triton.jit
    def _round_to_bfloat16(x_ptr, out_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(out_ptr + i, _to(tl.load(x_ptr + i), tl.bfloat16))

    @triton.jit
    def _round_to_float16(x_ptr, out_ptr, grid_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        x = tl.load(x_ptr + i)
        tl.store(out_ptr + i, _to(x, tl.float16))
        tl.store(grid_ptr + i, _on_grid(x, tl.float16))  # before the conversion


DTYPES = [torch.float32, torch.bfloat16]


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """float32: within a few ulp (the reductions' order differs). bfloat16: the same roundings
    as the torch ops, so nearly every value bit for bit; the rest, where a float32 sum of
    squares (or an exp) came out an ulp apart and a rounding flipped, within two ulp of the
    values' scale (rounding in the wrong places differs in about a quarter of them)."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        return
    torch.testing.assert_close(got.float(), expected.float(), atol=2**-6, rtol=2**-7)
    same = (got == expected).float().mean().item()
    assert same >= 0.99, f"only {same:.1%} of the bfloat16 values equal the torch ops'"


def _rows(num_rows: int, size: int, dtype, seed: int, spare: int = 0) -> torch.Tensor:
    """[num_rows, size] values of a few scales; with ``spare``, a view into wider rows."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-2, 1, num_rows).unsqueeze(1)
    wide = torch.randn(num_rows, size + spare, generator=gen) * scale
    return wide.to(DEVICE, dtype)[:, :size]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [64, 100, 1024])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_the_torch_ops(dtype, size, with_residual):
    x = _rows(7, size, dtype, seed=size, spare=5)  # rows strided like a slice of a wider output
    residual = _rows(7, size, dtype, seed=size + 1) if with_residual else None
    weight = (1.0 + 0.1 * torch.randn(size, generator=torch.Generator().manual_seed(3))).to(
        DEVICE, dtype
    )
    normed, summed = triton_ops.add_rms_norm(x, residual, weight, 1e-6)
    if residual is None:
        assert summed is None
        expected = rms_normalize(x, weight, 1e-6)
    else:
        expected_sum = x + residual
        assert torch.equal(summed, expected_sum)  # one rounding of an exact sum
        expected = rms_normalize(expected_sum, weight, 1e-6)
    assert normed.shape == x.shape and normed.dtype == dtype
    _close(normed, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("head_dim", "half"),
    [(128, 64), (64, 32), (80, 40), (128, 32)],  # the last: partial rotary, 64 dims left as is
)
@pytest.mark.parametrize("with_weight", [True, False])
def test_qk_norm_rope_matches_the_torch_ops_in_place(dtype, head_dim, half, with_weight):
    num_tokens, num_heads, num_kv_heads = 5, 4, 2
    heads = num_heads + num_kv_heads
    gen = torch.Generator().manual_seed(head_dim + half)
    # Queries and keys as the model has them: a view into the fused qkv projection's output.
    qkv = (torch.randn(num_tokens, (heads + num_kv_heads) * head_dim, generator=gen) * 3).to(
        DEVICE, dtype
    )
    qk = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    weight = None
    if with_weight:
        weight = (1.0 + 0.2 * torch.randn(heads, head_dim, generator=gen)).to(DEVICE, dtype)
    angle = torch.rand(num_tokens, 1, half, generator=gen) * 6.0
    angles = RotaryAngles(angle.cos().to(DEVICE, dtype), angle.sin().to(DEVICE, dtype))
    reference = qk.clone()
    if weight is not None:
        reference = rms_normalize(reference, weight, 1e-6)
    reference = rotate_(reference, angles)
    values = qkv[:, heads * head_dim :].clone()
    out = triton_ops.qk_norm_rope_(qk, weight, 1e-6, *angles)
    assert out.data_ptr() == qk.data_ptr()
    _close(qk, reference)
    assert torch.equal(qkv[:, heads * head_dim :], values)  # the values' columns untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("size", [96, 3000])  # 3000: three column blocks, the last partial
def test_silu_and_mul_matches_the_torch_ops(dtype, size):
    x = _rows(3, 2 * size, dtype, seed=size) * 3
    out = triton_ops.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate).mul_(up)
    assert out.shape == (3, size)
    # silu's exp may differ by an ulp between libraries: the rounding to bfloat16 then can too.
    _close(out, expected)


def test_the_layers_use_them_only_on_cuda_and_the_variable_turns_them_off(monkeypatch):
    cpu = torch.zeros(2, 4)
    assert not triton_ops.use_triton_ops(cpu)  # the CPU keeps its compiled ops
    triton_ops.triton_ops_enabled.cache_clear()
    assert triton_ops.triton_ops_enabled()
    with switch_set(monkeypatch, "CONVEYOR_TRITON_OPS", "0", triton_ops.triton_ops_enabled):
        assert not triton_ops.triton_ops_enabled()
    assert_refused(monkeypatch, "CONVEYOR_TRITON_OPS", "fasle", triton_ops.triton_ops_enabled)
    assert SiluAndMul()(torch.ones(1, 4)).shape == (1, 2)


# q/k norms; none; partial rotary; YaRN angles, sinks and experts with their own activation
@pytest.mark.parametrize("arch", ["qwen3", "llama", "phi3", "gpt_oss"])
def test_a_model_on_the_triton_ops_gives_the_torch_ops_tokens(arch, monkeypatch):
    # Through the layers' own dispatch (shapes, strides, the fused qkv views), on CPU by letting
    # the CPU take the Triton path in place of its compiled ops; the same tokens either way.
    from benchmarks.fixtures.model_maker import ensure_model
    from conveyor.frontend import LLM
    from conveyor.protocol import SamplingParams
    from conveyor.worker.layers import activation, norm, rotary

    calls = {"add_rms_norm": 0, "qk_norm_rope_": 0, "silu_and_mul": 0}
    for name in calls:
        original = getattr(triton_ops, name)

        def counted(*args, _original=original, _name=name):
            calls[_name] += 1
            return _original(*args)

        monkeypatch.setattr(triton_ops, name, counted)
    for module in (norm, rotary, activation):
        monkeypatch.setattr(module, "load_token_ops", lambda: None)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 17, 33, 2, 9], list(range(3, 40)), [100, 7]]
    tokens = {}
    for fused in (False, True):
        for module in (norm, rotary, activation):
            monkeypatch.setattr(module, "use_triton_ops", lambda x, fused=fused: fused)
        with LLM(
            str(ensure_model("tiny", arch)),
            engine="inprocess",
            device=DEVICE.type,
            dtype="float32",
            enforce_eager=True,
            # On CUDA a small pool: the rest of a 0.3 share is millions of the tiny model's
            # blocks, whose bookkeeping took most of this test's time there.
            **(
                {"gpu_memory_utilization": 0.3, "kv_cache_memory": 32 << 20}
                if DEVICE.type == "cuda"
                else {}
            ),
        ) as llm:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            tokens[fused] = [o.outputs[0].token_ids for o in outputs]
        if not fused:
            assert set(calls.values()) == {0}
    assert triton_ops.failure is None
    assert tokens[True] == tokens[False]
    assert calls["add_rms_norm"] > 0 and calls["qk_norm_rope_"] > 0
    assert (calls["silu_and_mul"] > 0) == (arch != "gpt_oss")  # its experts' SwiGLU is clamped


def test_a_kernel_that_cannot_run_turns_them_off_and_the_layers_keep_the_torch_ops(
    monkeypatch, caplog
):
    # A Triton that cannot compile them must cost a WARNING, not the engine: the first forward
    # (the memory profile's, eager) finds out, and every layer falls back from then on.
    from conveyor.worker.layers import norm, triton_token_kernels

    class Broken:
        def __getitem__(self, grid):
            raise RuntimeError("no compiler for this kernel")

    monkeypatch.setattr(triton_token_kernels, "add_rms_norm", Broken())
    monkeypatch.setattr(triton_ops, "failure", None)
    monkeypatch.setattr(norm, "load_token_ops", lambda: None)
    monkeypatch.setattr(norm, "use_triton_ops", lambda x: triton_ops.failure is None)
    layer = norm.RMSNorm(8)
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    with caplog.at_level("WARNING"):
        normed, summed = layer(x, residual)
    assert torch.equal(summed, x + residual)
    torch.testing.assert_close(normed, norm.rms_normalize(x + residual, layer.weight, 1e-6))
    assert triton_ops.failure == "add_rms_norm: RuntimeError: no compiler for this kernel"
    assert "Triton token ops off, using torch ops" in caplog.text


def test_nan_and_inf_come_out_as_the_torch_ops_give_them():
    # Hand-rounded bfloat16 must keep a NaN a NaN (its bits could carry into the sign).
    x = torch.tensor([[1.0, float("nan"), 2.0, 3.0], [1.0, float("inf"), 0.5, 1.0]])
    x = torch.cat([x, torch.ones(2, 12)], dim=1).to(DEVICE, torch.bfloat16)
    weight = torch.ones(16, dtype=torch.bfloat16, device=DEVICE)
    normed, _ = triton_ops.add_rms_norm(x, None, weight, 1e-6)
    expected = rms_normalize(x, weight, 1e-6)
    assert torch.equal(normed.isnan(), expected.isnan()) and normed.isnan().any()
    gated = torch.cat([x, x], dim=1)
    out = triton_ops.silu_and_mul(gated)
    reference = torch.nn.functional.silu(x).mul_(x)
    assert torch.equal(out.isnan(), reference.isnan())
    assert torch.equal(out.isinf(), reference.isinf())


def test_the_bfloat16_rounding_is_to_nearest_even_and_keeps_every_nan():
    # A GPU's arithmetic makes the NaN 0x7FFFFFFF, whose bits plus half an ulp would carry into
    # the sign and come out as -0.0 if rounded by hand; the interpreter's own NaNs would not show
    # it, so the bit patterns go in directly.
    patterns = [0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0x7F800001, 0x7F800000, 0xFF800000]
    nans = torch.tensor(patterns, dtype=torch.int64).to(torch.int32).view(torch.float32)
    gen = torch.Generator().manual_seed(0)
    ties = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 0.28906, 3.0e38, 1e-30])
    values = torch.cat([nans, ties, torch.randn(4, generator=gen) * 100]).to(DEVICE)
    out = torch.empty(16, dtype=torch.bfloat16, device=DEVICE)
    _round_to_bfloat16[(1,)](values, out, N=16)
    expected = values.to(torch.bfloat16)
    assert out[:4].isnan().all() and out.isnan().sum() == 4
    assert torch.equal(out[4:], expected[4:])  # inf, -inf, ties to even, extremes, randoms


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # to infinity, as due
def test_the_float16_rounding_is_to_nearest_even_bit_for_bit():
    # By hand too (a compiler may contract a plain conversion away, as one did for bfloat16):
    # ties to even among normal and subnormal values, the overflow to infinity, signed zeros,
    # NaNs, and values over float16's whole range, each bit for bit what torch's conversion gives.
    patterns = [0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0x7F800000, 0xFF800000, 0x80000000, 0]
    specials = torch.tensor(patterns, dtype=torch.int64).to(torch.int32).view(torch.float32)
    ties = [1.0 + 2**-11, 1.0 + 3 * 2**-11, -(1.0 + 2**-11), 2**-25, 3 * 2**-25, -(5 * 2**-25)]
    edges = [65504.0, 65519.0, 65520.0, -65520.0, 2**-14, 2**-14 - 2**-26, 2**-24, 1e-9]
    gen = torch.Generator().manual_seed(1)
    spread = torch.randn(4096 - 7 - 14, generator=gen) * torch.exp2(
        torch.randint(-30, 18, (4096 - 7 - 14,), generator=gen).float()
    )
    values = torch.cat([specials, torch.tensor(ties + edges), spread]).to(DEVICE)
    out = torch.empty(4096, dtype=torch.float16, device=DEVICE)
    on_grid = torch.empty(4096, dtype=torch.float32, device=DEVICE)
    _round_to_float16[(1,)](values, out, on_grid, N=4096)
    expected = values.to(torch.float16)
    assert torch.equal(out.isnan(), expected.isnan())
    numbers = ~expected.isnan()
    assert torch.equal(out[numbers].view(torch.int16), expected[numbers].view(torch.int16))
    # The rounding is done before the conversion, which then has nothing left to round (a
    # conversion that rounds would hide a wrong rounding by hand in the interpreter).
    finite = expected.isfinite()
    assert torch.equal(
        on_grid[finite].view(torch.int32), expected[finite].float().view(torch.int32)
    )
    assert (on_grid[expected.isinf()].abs() >= 65536).all()
