"""The CUDA quantized linears' Triton GEMM (worker/layers/quantization/triton_quant.py) against
what the weights mean.

On the CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set by
tests/devices.py): the same kernel source, each program executed with numpy; with
CONVEYOR_TEST_DEVICE=cuda it is compiled and run on the GPU. Weight-only layers are checked
against ``dequantized()`` times the input in float64; layers with quantized activations against
the torch path (the format's reference semantics: fake-quantized input times the dequantized
weight in float32), which rounds the input to the same codes. Shapes are not whole tiles: 1, 3
and 17 rows, outputs not a multiple of the column block, inputs not a multiple of FP8's 128-wide
blocks.
"""

from __future__ import annotations

import logging

import pytest
import torch

from conveyor.protocol.config import ConfigError
from conveyor.worker.attention.triton_backend import triton_import_error
from conveyor.worker.layers.quantization import triton_quant, triton_quant_kernels
from conveyor.worker.layers.quantization.packing import pack_nibbles
from conveyor.worker.layers.quantization.scheme import (
    FLOAT8,
    INT,
    ActivationScheme,
    LinearScheme,
    WeightScheme,
)
from conveyor.worker.layers.quantization.weights import QuantizedWeights
from tests.devices import TEST_DEVICE

pytestmark = [
    pytest.mark.gpu_kernel,
    pytest.mark.skipif(
        triton_import_error() is not None, reason=f"needs triton ({triton_import_error()})"
    ),
]
DEVICE = torch.device("cuda" if TEST_DEVICE == "cuda" else "cpu")
# Half-precision activations: float16 everywhere; bfloat16 on the GPU, where Triton's
# interpreter multiplies bfloat16 tiles wrong (tests/worker/test_triton_attention.py says the same).
HALF = [
    torch.float16,
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(DEVICE.type != "cuda", reason="bfloat16 dots need the GPU"),
    ),
]
# The output rows of a fused q/k/v with static input scales: one scale per part.
PARTS = (48, 32, 32)


@pytest.fixture(autouse=True)
def _kernels_on(monkeypatch):
    """Each test starts with the kernels on, whatever an earlier test's launches did."""
    monkeypatch.setattr(triton_quant, "failure", None)
    monkeypatch.setattr(triton_quant, "scaled_mm_failure", None)


def make_weights(
    scheme: LinearScheme, out_features: int, in_features: int, seed: int = 0
) -> QuantizedWeights:
    """Random codes, scales, zeros, act-order g_idx and static input scales for ``scheme``."""
    quant = QuantizedWeights(
        scheme, out_features, in_features, lambda shard: out_features, lambda *args: None
    )
    generator = torch.Generator().manual_seed(seed)
    w = scheme.weights
    if w.kind == INT:
        codes = torch.randint(0, 1 << w.bits, (out_features, in_features), generator=generator)
        quant.codes.data = pack_nibbles(codes) if w.bits == 4 else codes.to(torch.uint8)
    else:
        codes = torch.randn(out_features, in_features, generator=generator) * 40
        quant.codes.data = codes.to(torch.float8_e4m3fn)
    groups = quant.scales.shape[1]
    rows = -(-out_features // w.block_rows) if w.block_rows else out_features
    scales = torch.rand(rows, groups, generator=generator) * 0.02 + 0.005
    if w.block_rows:  # one scale per block of rows, spread over them as the loader does
        scales = scales.repeat_interleave(w.block_rows, dim=0)[:out_features]
    quant.scales.data = scales
    if not w.symmetric:
        zeros = torch.randint(0, 1 << w.bits, (out_features, groups), generator=generator)
        quant.zeros.data = zeros.float()
    if w.act_order:  # GPTQ's desc_act: whole groups, their features scattered
        order = torch.randperm(in_features, generator=generator)
        quant.g_idx.data = (torch.arange(in_features) // w.group_size)[order].to(torch.int32)
    a = scheme.activations
    if a is not None and not a.dynamic:
        values = [0.011, 0.02, 0.007]
        quant.input_scale.data = torch.cat(
            [torch.full((n, 1), v) for n, v in zip(PARTS, values, strict=True)]
        )
    return quant.to(DEVICE)


def _input(num_rows: int, in_features: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, in_features, generator=generator).to(dtype).to(DEVICE)


def _kernel_linear(quant, x, bias=None, fp8_matmul=False) -> torch.Tensor:
    plan = triton_quant.make_plan(quant, fp8_matmul=fp8_matmul)
    out = triton_quant.linear(quant, plan, x, bias)
    assert out is not None and triton_quant.failure is None, triton_quant.failure
    assert out.dtype == x.dtype and out.shape == (x.shape[0], quant.out_features)
    return out.cpu()


def _int(bits, group=0, symmetric=True, act_order=False) -> WeightScheme:
    return WeightScheme(INT, bits, group_size=group, symmetric=symmetric, act_order=act_order)


# (id, weight scheme, out, in): every layout weight-only layers come in.
WEIGHT_ONLY = [
    ("w4-g32", _int(4, 32), 96, 256),
    ("w4-g64-zeros", _int(4, 64, symmetric=False), 96, 256),
    ("w4-g128", _int(4, 128), 80, 256),
    ("w4-per-row-zeros", _int(4, 0, symmetric=False), 96, 200),
    ("w4-act-order-zeros", _int(4, 32, symmetric=False, act_order=True), 96, 256),
    ("w4-act-order", _int(4, 64, act_order=True), 96, 256),
    ("w4-g40-gathered", _int(4, 40), 72, 200),  # no tile depth divides 40
    ("w8-per-row", _int(8), 96, 256),
    ("w8-g64-zeros", _int(8, 64, symmetric=False), 96, 256),
    ("fp8-per-row", WeightScheme(FLOAT8, 8), 96, 256),
    ("fp8-blocks", WeightScheme(FLOAT8, 8, group_size=128, block_rows=128), 150, 200),
]


def _check_weight_only(scheme, out_features, in_features, num_rows, dtype):
    quant = make_weights(LinearScheme(scheme), out_features, in_features)
    x = _input(num_rows, in_features, dtype)
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = _kernel_linear(quant, x, bias.to(DEVICE))
    expected = x.cpu().double() @ quant.dequantized(torch.float64).cpu().T + bias.double()
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    elif scheme.act_order or scheme.group_size == 40:
        # The dequantized tile is rounded to the activations' dtype for the dot.
        torch.testing.assert_close(got.double(), expected, rtol=2e-2, atol=2e-2)
    else:  # exact codes through the dot; only the output's rounding
        torch.testing.assert_close(got.double(), expected, rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("num_rows", [1, 3, 17])
@pytest.mark.parametrize("case", WEIGHT_ONLY, ids=[c[0] for c in WEIGHT_ONLY])
def test_weight_only_float32_equals_the_dequantized_weight(case, num_rows):
    _check_weight_only(*case[1:], num_rows, torch.float32)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("case", WEIGHT_ONLY, ids=[c[0] for c in WEIGHT_ONLY])
def test_weight_only_half_precision_equals_the_dequantized_weight_to_its_rounding(case, dtype):
    _check_weight_only(*case[1:], 17, dtype)


def test_a_prompt_chunk_takes_the_wide_tiles():
    assert triton_quant.tile_for(130)[:2] == (128, 128)
    _check_weight_only(_int(4, 32, symmetric=False), 136, 128, 130, torch.float32)


INT8_W = _int(8)
FP8_W = WeightScheme(FLOAT8, 8)
FP8_BLOCKS = WeightScheme(FLOAT8, 8, group_size=128, block_rows=128)
# (id, scheme, out, in, fp8_matmul): the W8A8 schemes compressed-tensors and fp8 checkpoints use.
W8A8 = [
    ("int8-token", LinearScheme(INT8_W, ActivationScheme(INT, "token")), 96, 256, False),
    ("int8-tensor", LinearScheme(INT8_W, ActivationScheme(INT, "tensor")), 96, 256, False),
    ("int8-static", LinearScheme(INT8_W, ActivationScheme(INT, "tensor", False)), 112, 256, False),
    ("fp8-token", LinearScheme(FP8_W, ActivationScheme(FLOAT8, "token")), 96, 256, False),
    ("fp8-static", LinearScheme(FP8_W, ActivationScheme(FLOAT8, "tensor", False)), 112, 256, False),
    (
        "fp8-blocks-group",
        LinearScheme(FP8_BLOCKS, ActivationScheme(FLOAT8, "group", True, 128)),
        150,
        200,
        False,
    ),
    (
        "int4-act-order-int8-token",
        LinearScheme(_int(4, 32, act_order=True), ActivationScheme(INT, "token")),
        96,
        256,
        False,
    ),
    # torch._scaled_mm (the CPU has one too): the FP8 GPU path's arithmetic.
    ("fp8-token-scaled-mm", LinearScheme(FP8_W, ActivationScheme(FLOAT8, "token")), 96, 256, True),
    (
        "fp8-static-scaled-mm",
        LinearScheme(FP8_W, ActivationScheme(FLOAT8, "tensor", False)),
        112,
        256,
        True,
    ),
]


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
@pytest.mark.parametrize("num_rows", [1, 17])
@pytest.mark.parametrize("case", W8A8, ids=[c[0] for c in W8A8])
def test_quantized_activations_equal_the_reference_semantics(case, num_rows, dtype):
    _, scheme, out_features, in_features, fp8_matmul = case
    quant = make_weights(scheme, out_features, in_features)
    plan = triton_quant.make_plan(quant, fp8_matmul=fp8_matmul)
    assert plan.scaled_mm == fp8_matmul
    x = _input(num_rows, in_features, dtype) * 3
    got = _kernel_linear(quant, x, fp8_matmul=fp8_matmul)
    expected = quant.linear(x, None).cpu()  # no plan: the torch path
    # The same codes on both sides: only the order of float32 sums (and the output's rounding)
    # differ.
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    else:
        torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=2**-6)


ACT_ORDER = [
    ("w4-zeros", LinearScheme(_int(4, 32, symmetric=False, act_order=True))),
    ("w8", LinearScheme(_int(8, 64, act_order=True))),
    ("w4-int8-token", LinearScheme(_int(4, 32, act_order=True), ActivationScheme(INT, "token"))),
]


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
@pytest.mark.parametrize("num_rows", [1, 17])
@pytest.mark.parametrize("case", ACT_ORDER, ids=[c[0] for c in ACT_ORDER])
def test_act_order_weights_sorted_by_group_keep_their_meaning(case, num_rows, dtype):
    scheme = case[1]
    quant = make_weights(scheme, 96, 256)
    meaning = quant.dequantized(torch.float64)
    x = _input(num_rows, 256, dtype)
    reference = quant.linear(x, None).cpu()  # the torch path, before the features move
    triton_quant.sort_act_order_groups(quant)
    assert quant.input_order is not None
    assert torch.equal(quant.g_idx.cpu().long(), torch.arange(256) // scheme.weights.group_size)
    assert torch.equal(quant.dequantized(torch.float64), meaning)  # in the checkpoint's order
    plan = triton_quant.make_plan(quant)
    assert plan.g_idx is None and plan.input_order is quant.input_order  # tiled, not gathered
    got = _kernel_linear(quant, x)
    if scheme.activations is not None:  # the same codes as the torch path
        rtol, atol = (1e-5, 1e-4) if dtype == torch.float32 else (2**-7, 2**-6)
        torch.testing.assert_close(got.float(), reference.float(), rtol=rtol, atol=atol)
        return
    expected = x.cpu().double() @ meaning.cpu().T
    # Exact codes through the dot now, even in half precision: only the output's rounding.
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)


def test_act_order_groups_that_are_not_whole_runs_stay_gathered():
    quant = make_weights(LinearScheme(_int(4, 32, act_order=True)), 64, 128)
    uneven = torch.randint(0, 4, (128,), generator=torch.Generator().manual_seed(3))
    quant.g_idx.data = uneven.to(torch.int32).to(DEVICE)
    triton_quant.sort_act_order_groups(quant)
    assert quant.input_order is None and triton_quant.make_plan(quant).g_idx is not None
    # Per-group activations are grouped in the input's own order: not sorted either.
    grouped = ActivationScheme(FLOAT8, "group", True, 32)
    quant = make_weights(LinearScheme(_int(4, 32, act_order=True), grouped), 64, 128)
    triton_quant.sort_act_order_groups(quant)
    assert quant.input_order is None
    x = _input(3, 128, torch.float32)
    torch.testing.assert_close(_kernel_linear(quant, x), quant.linear(x, None).cpu())


def test_static_input_scales_are_read_into_parts_once_at_load():
    scheme = LinearScheme(INT8_W, ActivationScheme(INT, "tensor", False))
    plan = triton_quant.make_plan(make_weights(scheme, sum(PARTS), 64))
    assert [(p.start, p.end) for p in plan.static_parts] == [(0, 48), (48, 80), (80, 112)]
    assert [round(p.scale.item(), 6) for p in plan.static_parts] == [0.011, 0.02, 0.007]


def test_plans_pick_tiles_that_hold_one_scale_and_gather_otherwise():
    plan = triton_quant.make_plan(make_weights(LinearScheme(_int(4, 32)), 64, 128))
    assert (plan.block_k, plan.group_size, plan.g_idx) == (32, 32, None)
    plan = triton_quant.make_plan(make_weights(LinearScheme(_int(8, 0)), 64, 200))
    assert (plan.block_k, plan.group_size, plan.g_idx) == (64, 200, None)
    for scheme in (_int(4, 40), _int(4, 32, act_order=True)):
        quant = make_weights(LinearScheme(scheme), 64, 160)
        plan = triton_quant.make_plan(quant)
        assert plan.group_size == 0
        assert torch.equal(plan.g_idx.cpu().long(), quant.group_of_each_input().cpu())
    # FP8 x FP8 takes _scaled_mm only with one scale per operand and sides of 16s.
    token = ActivationScheme(FLOAT8, "token")
    assert not triton_quant.make_plan(
        make_weights(LinearScheme(FP8_BLOCKS, token), 128, 256), fp8_matmul=True
    ).scaled_mm
    assert not triton_quant.make_plan(
        make_weights(LinearScheme(FP8_W, token), 72, 256), fp8_matmul=True
    ).scaled_mm


def test_the_layer_takes_the_kernel_and_a_failed_launch_falls_back_once(monkeypatch, caplog):
    monkeypatch.setattr(triton_quant, "failure", None)
    quant = make_weights(LinearScheme(_int(4, 32, symmetric=False)), 96, 128)
    x = _input(3, 128, torch.float32).reshape(1, 3, 128)  # a leading batch dimension
    reference = quant.linear(x, None)
    quant.kernel_plan = triton_quant.make_plan(quant)
    launches = []
    kernel = triton_quant_kernels.quant_gemm

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(triton_quant_kernels, "quant_gemm", Counting())
    got = quant.linear(x, None)
    assert launches and got.shape == (1, 3, 96)
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)

    class Broken:
        def __getitem__(self, grid):
            raise RuntimeError("no kernel for this Triton")

    monkeypatch.setattr(triton_quant_kernels, "quant_gemm", Broken())
    with caplog.at_level(logging.WARNING):
        got = quant.linear(x, None)
        again = quant.linear(x, None)
    assert torch.equal(got, reference) and torch.equal(again, reference)
    assert "no kernel for this Triton" in triton_quant.failure
    assert sum("quantized kernels off" in r.message for r in caplog.records) == 1


def test_the_switch_turns_the_kernels_off_and_refuses_nonsense(monkeypatch):
    quant = make_weights(LinearScheme(_int(4, 32)), 64, 128)
    for value, planned in (("0", False), ("off", False), ("1", True)):
        monkeypatch.setenv(triton_quant.KERNEL_ENV, value)
        triton_quant.kernels_enabled.cache_clear()
        assert (triton_quant.make_plan(quant) is not None) == planned
    monkeypatch.setenv(triton_quant.KERNEL_ENV, "maybe")
    triton_quant.kernels_enabled.cache_clear()
    with pytest.raises(ConfigError, match=triton_quant.KERNEL_ENV):
        triton_quant.make_plan(quant)
    monkeypatch.delenv(triton_quant.KERNEL_ENV)
    triton_quant.kernels_enabled.cache_clear()


def test_an_empty_step_launches_nothing():
    quant = make_weights(LinearScheme(_int(4, 32)), 64, 128)
    out = triton_quant.linear(
        quant, triton_quant.make_plan(quant), _input(0, 128, torch.float32), None
    )
    assert out.shape == (0, 64)


# ------------------------------------------------------------------ in the engine

# Tiny Qwen3 checkpoints (benchmarks/fixtures/quantized_maker.py) whose linears take the
# kernel's paths: act-order with zeros, int8 activations per token, FP8 with the checkpoint's
# static input scales through _scaled_mm. Activation-quantized ones compare at the parity tests'
# tolerance (a rounding boundary flips on one side only: tests/frontend/test_parity_quantized.py).
ENGINE_CASES = [
    ("gptq-act-order", "gptq", dict(sym=False, desc_act=True), 1e-4),
    ("ct-w8a8", "compressed-tensors", dict(preset="W8A8", group=0), 0.5),
    ("ct-fp8-static", "compressed-tensors", dict(preset="FP8", group=0), 0.5),
]


def _engine_tokens(model_dir, prompts):
    from conveyor.frontend import LLM
    from conveyor.protocol import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    with LLM(
        str(model_dir), engine="inprocess", device="cpu", dtype="float32", seed=0,
        kv_cache_memory=16 << 20,
    ) as llm:  # fmt: skip
        return [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the CPU engine with the kernels planned")
@pytest.mark.parametrize("case", ENGINE_CASES, ids=[c[0] for c in ENGINE_CASES])
def test_an_engine_with_the_kernels_gives_the_torch_paths_tokens(case, tiny_model_dir, monkeypatch):
    from benchmarks.fixtures.quantized_maker import ensure_quantized

    _, kind, options, tolerance = case
    model_dir = ensure_quantized(tiny_model_dir, kind, **options)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 2000, (n,), generator=generator).tolist() for n in (7, 19, 33)]
    reference = _engine_tokens(model_dir, prompts)
    launches = []
    linear = triton_quant.linear
    monkeypatch.setattr(triton_quant, "linear", lambda *a: launches.append(1) or linear(*a))

    sorted_layers = []

    def plan_instead(quant):  # as on CUDA, in place of the CPU's own 4-bit kernel
        triton_quant.sort_act_order_groups(quant)
        if quant.input_order is not None:
            sorted_layers.append(quant)
        quant.kernel_plan = triton_quant.make_plan(quant, fp8_matmul=True)

    monkeypatch.setattr(QuantizedWeights, "process_weights_after_loading", plan_instead)
    ours = _engine_tokens(model_dir, prompts)
    assert launches and triton_quant.failure is None and triton_quant.scaled_mm_failure is None
    if kind == "gptq":  # desc_act's groups are whole runs: sorted, not gathered
        assert sorted_layers
    for prompt, a, b in zip(prompts, ours, reference, strict=True):
        same = next((p for p, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        for p in range(len(a.token_ids) if same is None else same):
            token = a.token_ids[p]
            assert abs(a.logprobs[p][token] - b.logprobs[p][token]) < tolerance
        if same is not None:  # a near tie, reported by name
            top = b.logprobs[same]
            gap = abs(top[b.token_ids[same]] - top.get(a.token_ids[same], float("-inf")))
            assert gap < max(tolerance, 1e-3), f"prompt of {len(prompt)}: differs at {same}"
            print(f"near tie: prompt of {len(prompt)} tokens at {same}, gap {gap:.3g}")
