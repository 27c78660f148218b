"""The compiled CPU kernel's bfloat16 build: bfloat16 queries, cache and output, float32 inside.

The reference is the float32 kernel on the same values (the bfloat16 inputs widened, exactly): the
bfloat16 build must give that result rounded once to bfloat16, so every output element is within
half a bfloat16 step of it (plus float32 noise). The float32 kernel is itself checked against the
torch path and dense float64 attention (test_prefill_kernel.py, test_attention.py).

On a host with AMX the query tiles also run on AMX tiles (csrc/amx_tiles.h), which round the
softmax weights to bfloat16 before multiplying the values: each output element is then also
within 2^-8 of the weighted sum of the values' magnitudes (that is, the float32 kernel over |V|),
besides its own rounding. Every check runs both ways: ``path`` "fma" (AMX off) and "amx".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from conveyor.frontend.engine_args import EngineArgs
from conveyor.protocol.config import ConfigError
from conveyor.worker.attention.cpu_kernel import PagedAttentionKernel, amx_wanted, load_kernel
from conveyor.worker.attention.torch_backend import TorchAttentionBackend
from conveyor.worker.model_runner import ModelRunner
from tests.devices import logprob_tolerance
from tests.worker.test_attention import Request, step_inputs, store_prefix
from tests.worker.test_cuda import _prompts, logprob_error, teacher_forced_logprobs
from tests.worker.test_prefill_kernel import BLOCK_SIZE, make_batch

pytestmark = pytest.mark.skipif(
    load_kernel(torch.bfloat16) is None, reason="the CPU kernel cannot be built"
)
# Round to nearest: at most half of bfloat16's 2^-7 relative step, with room for float32 noise
# that moves a value across a rounding boundary.
BF16_RTOL = 2**-8 + 1e-5


def as_dtype(requests: list[Request], dtype: torch.dtype) -> list[Request]:
    return [
        dataclasses.replace(
            r, keys=r.keys.to(dtype), values=r.values.to(dtype), query=r.query.to(dtype)
        )
        for r in requests
    ]


def run_step(requests, num_blocks, dtype, kv_dtype=None, use_cpu_kernel=True, **layer):
    """(output, cache after the step, the (dtype, kv_dtype) of each kernel call) of one step of
    ``dtype`` queries over a ``kv_dtype`` cache (default: ``dtype``), the cached prefixes stored
    as that cache holds them."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    num_kv_heads, head_dim = requests[0].keys.shape[1:]
    shape = TorchAttentionBackend.kv_cache_shape(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    kv_cache = torch.zeros(shape, dtype=kv_dtype)
    for r in requests:
        cached = dataclasses.replace(r, keys=r.keys.to(kv_dtype), values=r.values.to(kv_dtype))
        store_prefix(kv_cache, cached, BLOCK_SIZE)
    metadata, _, query, key, value = step_inputs(requests, BLOCK_SIZE)
    backend = TorchAttentionBackend(use_cpu_kernel=use_cpu_kernel)
    calls = []
    original = PagedAttentionKernel.attend

    def counting(self, *args, **kwargs):
        calls.append((self.dtype, self.kv_dtype))
        original(self, *args, **kwargs)

    PagedAttentionKernel.attend = counting
    try:
        output = backend.forward(query, key, value, kv_cache, metadata, head_dim**-0.5, **layer)
    finally:
        PagedAttentionKernel.attend = original
    assert output.dtype == dtype
    return output, kv_cache, calls


def run_kernel(requests: list[Request], num_blocks: int, dtype: torch.dtype, **layer):
    """(output, cache after the step) of the kernel path in ``dtype``."""
    output, kv_cache, calls = run_step(requests, num_blocks, dtype, **layer)
    assert calls == [(dtype, dtype)], "the step did not go through the compiled kernel"
    return output, kv_cache


# The AMX path's weights, rounded to bfloat16 before the value product: at most half a step,
# 2^-8 of each weight.
WEIGHT_ROUNDING = 2**-8


@pytest.fixture(params=["fma", "amx"])
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    """The bfloat16 build's query tiles with FMAs on float32, or on AMX tiles where the host
    has them (the default there)."""
    kernel = load_kernel(torch.bfloat16)
    default = kernel.amx
    if not kernel.set_amx(request.param == "amx") and request.param == "amx":
        kernel.set_amx(default)
        pytest.skip("needs a host with AMX-BF16 (lscpu: amx_bf16) and Linux 5.16 or later")
    yield request.param
    kernel.set_amx(default)


def assert_rounded_from(
    bf16_out: torch.Tensor,
    reference: torch.Tensor,
    path: str = "fma",
    magnitudes: torch.Tensor | None = None,
) -> None:
    """``bf16_out`` is ``reference`` rounded once to bfloat16; on the AMX path, give or take
    WEIGHT_ROUNDING of ``magnitudes`` (the float32 kernel's output over |V|)."""
    if path == "fma":
        torch.testing.assert_close(bf16_out.float(), reference, rtol=BF16_RTOL, atol=1e-6)
        return
    error = (bf16_out.float() - reference).abs()
    bound = BF16_RTOL * reference.abs() + WEIGHT_ROUNDING * magnitudes + 1e-6
    worst = (error / bound).max().item()
    assert worst <= 1.0, f"an output is {worst:.2f}x its bound from the float32 result"


def magnitudes_of(requests: list[Request], num_blocks: int, **layer) -> torch.Tensor:
    """The float32 kernel's output with every value replaced by its magnitude: the weighted sum
    of |V| that bounds what rounding the weights can move an output."""
    absolute = [dataclasses.replace(r, values=r.values.abs()) for r in requests]
    return run_kernel(as_dtype(absolute, torch.float32), num_blocks, torch.float32, **layer)[0]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (8, 4), (8, 2), (16, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_mixed_step_is_the_float32_result_rounded(num_heads, num_kv_heads, head_dim, path):
    # Decodes and prompt chunks of several lengths (short items and query tiles), after cached
    # prefixes on and off block boundaries.
    shapes = [(300, 1), (45, 300), (0, 130), (17, 1), (64, 64), (5, 3), (37, 1000)]
    requests, num_blocks = make_batch(
        7 + head_dim + num_heads, shapes, num_heads, num_kv_heads, head_dim
    )
    bf16 = as_dtype(requests, torch.bfloat16)
    out_bf16, cache_bf16 = run_kernel(bf16, num_blocks, torch.bfloat16)
    out_fp32, cache_fp32 = run_kernel(as_dtype(bf16, torch.float32), num_blocks, torch.float32)
    assert_rounded_from(out_bf16, out_fp32, path, magnitudes_of(bf16, num_blocks))
    # The step's keys and values were stored bit for bit.
    assert torch.equal(cache_bf16.float(), cache_fp32)


@pytest.mark.parametrize(
    "window,with_sinks,softcap",
    [(100, False, None), (None, True, None), (None, False, 30.0), (5, True, 30.0)],
    ids=["window", "sinks", "softcap", "all-three"],
)
def test_windows_sinks_and_softcaps(window, with_sinks, softcap, path):
    shapes = [(37, 500), (250, 1), (0, 40)]
    requests, num_blocks = make_batch(11, shapes, 8, 2, 64)
    # Sinks stay float32 (one logit per head, as the models keep them).
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(2)) if with_sinks else None
    layer = {"sliding_window": window, "sinks": sinks, "softcap": softcap}
    bf16 = as_dtype(requests, torch.bfloat16)
    out_bf16, _ = run_kernel(bf16, num_blocks, torch.bfloat16, **layer)
    out_fp32, _ = run_kernel(as_dtype(bf16, torch.float32), num_blocks, torch.float32, **layer)
    assert_rounded_from(out_bf16, out_fp32, path, magnitudes_of(bf16, num_blocks, **layer))


def test_the_bfloat16_build_is_closer_to_exact_than_the_torch_bfloat16_path(path):
    """What the build is for: float32 arithmetic inside, one rounding at the end. The torch path
    in bfloat16 rounds its scores and weights along the way."""
    requests, num_blocks = make_batch(5, [(500, 1), (100, 200), (0, 64)], 8, 2, 64)
    bf16 = as_dtype(requests, torch.bfloat16)
    exact, _ = run_kernel(as_dtype(bf16, torch.float32), num_blocks, torch.float32)
    kernel_out, _ = run_kernel(bf16, num_blocks, torch.bfloat16)
    num_kv_heads, head_dim = requests[0].keys.shape[1:]
    shape = TorchAttentionBackend.kv_cache_shape(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    kv_cache = torch.zeros(shape, dtype=torch.bfloat16)
    for r in bf16:
        store_prefix(kv_cache, r, BLOCK_SIZE)
    metadata, _, query, key, value = step_inputs(bf16, BLOCK_SIZE)
    torch_out = TorchAttentionBackend(use_cpu_kernel=False).forward(
        query, key, value, kv_cache, metadata, head_dim**-0.5
    )
    kernel_error = (kernel_out.float() - exact).abs().max().item()
    torch_error = (torch_out.float() - exact).abs().max().item()
    assert kernel_error <= torch_error, (kernel_error, torch_error)


def test_other_dtypes_have_no_build():
    assert load_kernel(torch.float16) is None
    kernel = load_kernel(torch.bfloat16)
    query = torch.zeros(3, 8, 64, dtype=torch.bfloat16)
    cache = torch.zeros(TorchAttentionBackend.kv_cache_shape(4, 16, 2, 64), dtype=torch.bfloat16)
    assert kernel.supports(query, cache)
    assert not kernel.supports(query.float(), cache.float())  # the float32 build's
    assert not load_kernel(torch.float32).supports(query, cache)


def test_a_bfloat16_model_on_the_kernel_is_as_close_to_float32_as_on_torch_ops(tiny_model_dir):
    """The whole tiny Qwen3, a prefill step and a decode step on the same tokens (teacher forced,
    full vocabulary): the bfloat16 run through the compiled kernels within twice the torch-ops
    bfloat16 run's distance from the float32 run (or the bfloat16 tolerance, if larger)."""
    prompts = _prompts(4, vocab=1000, seed=3)
    next_tokens = [17, 404, 250, 777]
    runs = {}
    for backend, dtype in (("torch", "float32"), ("torch", "bfloat16"), ("cpu-kernel", "bfloat16")):
        config = EngineArgs(
            model=str(tiny_model_dir), device="cpu", dtype=dtype, attention_backend=backend,
            max_num_seqs=8, max_model_len=256, block_size=16, kv_cache_memory=16 << 20,
        ).create_engine_config()  # fmt: skip
        runner = ModelRunner(config, torch.device("cpu"))
        runner.initialize_cache(runner.determine_num_blocks())
        runs[backend, dtype] = teacher_forced_logprobs(runner, prompts, next_tokens)
        if backend == "cpu-kernel":
            assert runner.backend.cpu_kernel.dtype == torch.bfloat16  # the bfloat16 build ran
        runner.release()
    reference = runs["torch", "float32"]
    torch_error = logprob_error(runs["torch", "bfloat16"], reference)
    kernel_error = logprob_error(runs["cpu-kernel", "bfloat16"], reference)
    print(
        f"bfloat16 vs float32 logprob error: torch ops {torch_error:.4f}, kernel {kernel_error:.4f}"
    )
    assert np.isfinite(torch_error) and np.isfinite(kernel_error)
    assert kernel_error <= max(2 * torch_error, logprob_tolerance("bfloat16")), (
        kernel_error,
        torch_error,
    )


def _host_has_amx() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return " amx_bf16" in flags and " avx512_bf16" in flags


@pytest.mark.skipif(not _host_has_amx(), reason="needs a host with AMX-BF16 (lscpu: amx_bf16)")
def test_a_host_with_amx_runs_its_query_tiles_on_amx_tiles():
    """Where the CPU has AMX the bfloat16 build uses it by default (a build or permission that
    silently fell back would pass every tolerance above), and it is another computation."""
    kernel = load_kernel(torch.bfloat16)
    assert kernel.amx, "the host has AMX-BF16 but the kernel did not turn it on (Linux < 5.16?)"
    requests, num_blocks = make_batch(3, [(100, 200), (0, 64)], 8, 2, 128)
    bf16 = as_dtype(requests, torch.bfloat16)
    on, _ = run_kernel(bf16, num_blocks, torch.bfloat16)
    try:
        kernel.set_amx(False)
        off, _ = run_kernel(bf16, num_blocks, torch.bfloat16)
    finally:
        kernel.set_amx(True)
    assert not torch.equal(on, off)


def test_a_cpu_amx_value_that_is_neither_on_nor_off_is_refused(monkeypatch):
    monkeypatch.setenv("CONVEYOR_CPU_AMX", "maybe")
    with pytest.raises(ConfigError, match="CONVEYOR_CPU_AMX='maybe'"):
        amx_wanted()
    monkeypatch.setenv("CONVEYOR_CPU_AMX", "off")
    assert not amx_wanted()
