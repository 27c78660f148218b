"""--kv-cache-dtype bfloat16 on a float32 model: float32 queries and outputs over a bfloat16 cache.

The kernel's CONVEYOR_KV_BF16 build must be exactly the float32 kernel run on keys and values
already rounded to bfloat16 (same arithmetic, same order; only the loads widen), and store what
torch's .to(bfloat16) would. The torch path (no compiler, or shapes the kernel refuses) must give
the same attention within float32 noise. Then the engine: twice the blocks in the same bytes, and
the refusals.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conveyor.frontend.engine_args import EngineArgs
from conveyor.protocol import ConfigError
from conveyor.worker.attention.cpu_kernel import load_kernel
from conveyor.worker.attention.torch_backend import TorchAttentionBackend
from tests.worker import test_cpu_kernel_bf16 as bf16_tests
from tests.worker.test_attention import Request
from tests.worker.test_prefill_kernel import BLOCK_SIZE, make_batch

needs_kernel = pytest.mark.skipif(
    load_kernel(torch.float32, torch.bfloat16) is None, reason="the CPU kernel cannot be built"
)
SHAPES = [(300, 1), (45, 300), (0, 130), (17, 1), (64, 64), (5, 3), (37, 1000)]


def rounded(requests: list[Request]) -> list[Request]:
    """The requests with keys and values as a bfloat16 cache holds them, still float32."""
    return [
        dataclasses.replace(
            r,
            keys=r.keys.to(torch.bfloat16).float(),
            values=r.values.to(torch.bfloat16).float(),
        )
        for r in requests
    ]


def run_step(requests, num_blocks, kv_dtype, use_cpu_kernel=True, **layer):
    """(output, cache after the step, kernel calls) for float32 queries over a kv_dtype cache."""
    return bf16_tests.run_step(
        requests, num_blocks, torch.float32, kv_dtype, use_cpu_kernel, **layer
    )


@needs_kernel
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (8, 4), (8, 2), (16, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_kernel_is_the_float32_kernel_on_rounded_keys_and_values(
    num_heads, num_kv_heads, head_dim
):
    # Decodes and prompt chunks (short items and query tiles), prefixes on and off block edges.
    requests, num_blocks = make_batch(
        3 + head_dim + num_heads, SHAPES, num_heads, num_kv_heads, head_dim
    )
    out, cache, calls = run_step(requests, num_blocks, torch.bfloat16)
    assert calls == [(torch.float32, torch.bfloat16)]
    expected, expected_cache, calls = run_step(rounded(requests), num_blocks, torch.float32)
    assert calls == [(torch.float32, torch.float32)]
    assert torch.equal(out, expected)
    # This step's keys and values were rounded as they were stored, as torch rounds.
    assert torch.equal(cache.float(), expected_cache)


@needs_kernel
@pytest.mark.parametrize(
    "window,with_sinks,softcap",
    [(100, False, None), (None, True, None), (None, False, 30.0), (5, True, 30.0)],
    ids=["window", "sinks", "softcap", "all-three"],
)
def test_windows_sinks_and_softcaps(window, with_sinks, softcap):
    requests, num_blocks = make_batch(11, [(37, 500), (250, 1), (0, 40)], 8, 2, 64)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(2)) if with_sinks else None
    layer = {"sliding_window": window, "sinks": sinks, "softcap": softcap}
    out, _, _ = run_step(requests, num_blocks, torch.bfloat16, **layer)
    expected, _, _ = run_step(rounded(requests), num_blocks, torch.float32, **layer)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("window", [None, 100])
def test_the_torch_path_reads_what_the_cache_holds(window):
    # Without the kernel: the cache still holds rounded values, and the chunk that has no cached
    # prefix attends to its own keys as rounded, not as computed, so both paths agree.
    requests, num_blocks = make_batch(5, SHAPES, 8, 2, 64)
    out, cache, calls = run_step(
        requests, num_blocks, torch.bfloat16, use_cpu_kernel=False, sliding_window=window
    )
    assert calls == []
    expected, expected_cache, _ = run_step(
        rounded(requests), num_blocks, torch.float32, use_cpu_kernel=False, sliding_window=window
    )
    assert torch.equal(cache.float(), expected_cache)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    if load_kernel(torch.float32, torch.bfloat16) is not None:
        kernel_out, _, _ = run_step(requests, num_blocks, torch.bfloat16, sliding_window=window)
        torch.testing.assert_close(out, kernel_out, atol=2e-5, rtol=1e-5)


@needs_kernel
def test_writes_round_to_nearest_even_as_torch_does():
    kernel = load_kernel(torch.float32, torch.bfloat16)
    # Ties both ways, just above and below them, signs, tiny and huge values, inf.
    base = torch.tensor([1.0, 1.00390625, 1.01171875, -1.00390625, 3e-39, 3.4e38, float("inf")])
    values = torch.cat([base, base + 1e-7, base - 1e-7, torch.randn(64 * 3 - 21)])
    key = values[: 64 * 3].view(3, 1, 64)
    value = -key
    cache = torch.zeros(TorchAttentionBackend.kv_cache_shape(2, BLOCK_SIZE, 1, 64))
    cache = cache.to(torch.bfloat16)
    kernel.write_kv(cache, key, value, torch.tensor([0, 17, 5]))
    assert torch.equal(cache[0, 0, 0, 0], key[0, 0].to(torch.bfloat16))
    assert torch.equal(cache[0, 0, 1, 1], key[1, 0].to(torch.bfloat16))
    assert torch.equal(cache[1, 0, 0, 5], value[2, 0].to(torch.bfloat16))


def test_a_float32_model_gets_twice_the_blocks_in_the_same_bytes(tiny_model_dir):
    from conveyor.worker.model_runner import ModelRunner

    blocks = {}
    for cache_dtype in ("auto", "bfloat16"):
        args = EngineArgs(
            model=str(tiny_model_dir), kv_cache_memory=1 << 20, kv_cache_dtype=cache_dtype
        )
        runner = ModelRunner(args.create_engine_config(), torch.device("cpu"))
        assert runner.dtype == torch.float32
        blocks[cache_dtype] = runner.determine_num_blocks()
        runner.initialize_cache(blocks[cache_dtype])
        assert runner.attention_layers[0].kv_cache.dtype == (
            torch.float32 if cache_dtype == "auto" else torch.bfloat16
        )
    assert blocks["bfloat16"] == 2 * blocks["auto"]


def test_unsupported_cache_dtypes_and_devices_are_refused(tiny_model_dir):
    model = str(tiny_model_dir)
    for name in ("fp8", "fp8_e4m3", "float16"):
        with pytest.raises(
            ConfigError, match=f"kv_cache_dtype must be one of auto, bfloat16.*'{name}'"
        ):
            EngineArgs(model=model, kv_cache_dtype=name).create_engine_config()
    with pytest.raises(ConfigError, match="with a float32 model runs on CPU only, not 'cuda'"):
        EngineArgs(
            model=model, kv_cache_dtype="bfloat16", dtype="float32", device="cuda"
        ).create_engine_config()
    # A bfloat16 model's cache is bfloat16 anyway: asking for it is allowed everywhere.
    config = EngineArgs(
        model=model, kv_cache_dtype="bfloat16", dtype="bfloat16", device="cuda"
    ).create_engine_config()
    assert config.cache.cache_dtype == "bfloat16"
