"""Microbenchmark: attention per layer against the same layer's matmuls, on the same tokens.

Runs standalone (one process). For each scenario it times one attention backend call (KV write
included) and the four linears of one decoder layer of the bench model (qkv, o, gate_up, down)
for the same number of tokens, and prints microseconds per call per layer (medians) and the
ratio, so one can read off whether attention is the bottleneck. On CPU the torch backend is timed
twice, on its pure-torch path and with the compiled kernel (cpu_kernel.py), side by side.

    python -m benchmarks attention                 # bench model, CPU, torch backend
    python -m benchmarks attention --query-lens 2,8,16,32,64   # 8 short chunks after a cached prefix
    python -m benchmarks attention --chunk-lens 16,256,2048 --contexts 0,2048   # one prompt chunk
    python -m benchmarks attention --device cuda --dtype bfloat16 --block-size 256

--chunk-lens times one prompt chunk of each length after each cached context, with the chunk's
attention GFLOP/s (causal: every query row against the keys it sees, two matmuls) per path.
--compare-kernel DIR times two versions of the compiled kernel instead (DIR: another commit's
worker/attention/csrc, from ``git worktree add``), interleaved on the same inputs.
--compare-amx times the bfloat16 build's AMX tile path against its FMA path (AMX off), interleaved
on the same inputs, on a host with AMX:

    python -m benchmarks attention --dtype bfloat16 --compare-amx --chunk-lens 256,2048 \
        --contexts 0,2048
--triton-configs times the Triton kernel with other tile shapes and launch settings beside its
defaults (on a GPU; on CPU it runs in Triton's interpreter, for the tests), each checked to give
the defaults' output first:

    python -m benchmarks attention --device cuda --dtype bfloat16 --backend triton \
        --num-heads 16 --num-kv-heads 8 --head-dim 128 --chunk-lens 2048,8192 --contexts 0,8192 \
        --triton-configs 64x32/w4,128x64/w8/s3,128x32/w8/s2
--cold reads a buffer several times the last-level cache before every timed call, so the KV
cache, queries and weights come from memory, as in a served step, where the other layers' caches
and weights pass through between one layer's calls (warm, the 25 MB of `64 decodes, ctx 128-256`
stay in a 32 MB L3 and the decode path reads about twice as fast as it does end to end).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from conveyor.bench.machine import machine_info
from conveyor.protocol.config import KV_CACHE_DTYPES
from conveyor.worker.attention.cpu_kernel import load_kernel, load_kernel_from
from conveyor.worker.attention.metadata_builder import build_attention_metadata
from conveyor.worker.attention.selector import select_backend
from conveyor.worker.attention.torch_backend import TorchAttentionBackend
from conveyor.worker.attention.triton_backend import KernelConfig, TritonAttentionBackend
from conveyor.worker.kv_cache import allocate_kv_caches


@dataclass(frozen=True)
class Scenario:
    name: str
    # Per request: tokens already cached and tokens scheduled this step.
    num_computed: list[int]
    num_scheduled: list[int]


def make_scenarios(
    rng: np.random.Generator, query_lens: list[int], chunk_lens: list[int], contexts: list[int]
) -> list[Scenario]:
    if chunk_lens:
        # One prompt chunk after a cached context: the prefill shapes, from 1 token to thousands.
        return [Scenario(f"chunk {q}, ctx {c}", [c], [q]) for c in contexts for q in chunk_lens]

    def decodes(n: int, low: int, high: int) -> tuple[list[int], list[int]]:
        return [int(c) - 1 for c in rng.integers(low, high + 1, n)], [1] * n

    if query_lens:
        # Short prompt chunks after a cached prefix: which path should take a query this long.
        return [
            Scenario(f"8 chunks of {q}, ctx {ctx}", [ctx - q] * 8, [q] * 8)
            for ctx in (256, 1024)
            for q in query_lens
        ]

    scenarios = [Scenario(f"64 decodes, ctx {c}", *decodes(64, c, c)) for c in (128, 256, 1024)]
    scenarios.append(Scenario("64 decodes, ctx 128-256", *decodes(64, 128, 256)))
    # Few requests with long contexts: where a GPU splits each request's keys (split-K).
    scenarios.append(Scenario("1 decode, ctx 8192", *decodes(1, 8192, 8192)))
    scenarios.append(Scenario("8 decodes, ctx 2048", *decodes(8, 2048, 2048)))
    scenarios.append(Scenario("1 prefill of 512", [0], [512]))
    computed, scheduled = decodes(63, 128, 256)
    scenarios.append(Scenario("512 prefill + 63 decodes", [0, *computed], [512, *scheduled]))
    return scenarios


def block_table_for(scenario: Scenario, block_size: int, rng: np.random.Generator) -> np.ndarray:
    """Shuffled, non-contiguous blocks, as a long-running server would hand them out."""
    seq_lens = np.add(scenario.num_computed, scenario.num_scheduled)
    blocks_per_req = -(-seq_lens // block_size)
    pool = rng.permutation(int(blocks_per_req.sum()) + 1)
    table = np.zeros((len(seq_lens), int(blocks_per_req.max())), dtype=np.int32)
    start = 0
    for i, n in enumerate(blocks_per_req):
        table[i, :n] = pool[start : start + n]
        start += n
    return table


def time_us(
    fn: Callable[[], object],
    repeats: int,
    device: torch.device,
    before: Callable[[], object] | None = None,
) -> float:
    """Median microseconds per call of ``fn``; ``before`` (untimed) runs ahead of each call."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        if before is not None:
            before()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def layer_matmuls(args: argparse.Namespace, num_tokens: int, dtype: torch.dtype, device):
    """The bench model's four linears for one layer, on ``num_tokens`` tokens."""
    shapes = [
        (args.hidden_size, (args.num_heads + 2 * args.num_kv_heads) * args.head_dim),
        (args.num_heads * args.head_dim, args.hidden_size),
        (args.hidden_size, 2 * args.intermediate_size),
        (args.intermediate_size, args.hidden_size),
    ]
    weights = [torch.randn(out_f, in_f, dtype=dtype, device=device) for in_f, out_f in shapes]
    inputs = [torch.randn(num_tokens, in_f, dtype=dtype, device=device) for in_f, _ in shapes]

    def run() -> None:
        for x, w in zip(inputs, weights):
            torch.nn.functional.linear(x, w)

    return run


def last_level_cache_bytes(cache_dir: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The largest CPU cache Linux reports for cpu0 (0 where it reports none)."""
    sizes = []
    for entry in cache_dir.glob("index*/size"):
        text = entry.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=0)


def cache_flusher() -> Callable[[], object]:
    """Evicts the CPU's caches by reading a buffer of four times the last-level cache, and at
    least 128 MiB; reads, so no dirty lines are written back during the timed call."""
    buffer = torch.ones(max(4 * last_level_cache_bytes(), 128 << 20) // 4, dtype=torch.float32)
    return lambda: buffer.sum()


def bench_scenario(
    args, scenario: Scenario, backends: list, rng, dtype, device
) -> tuple[list[float], float]:
    kv_dtype = kv_cache_dtype(args, dtype)
    table = block_table_for(scenario, args.block_size, rng)
    metadata, _ = build_attention_metadata(
        np.array(scenario.num_scheduled, dtype=np.int32),
        np.array(scenario.num_computed, dtype=np.int32),
        table,
        args.block_size,
        device,
    )
    num_blocks = int(table.max()) + 1
    (kv_cache,) = allocate_kv_caches(
        1, num_blocks, args.block_size, args.num_kv_heads, args.head_dim, kv_dtype, device,
        backends[0],
    )  # fmt: skip
    kv_cache.normal_()
    num_tokens = metadata.num_actual_tokens
    query = torch.randn(num_tokens, args.num_heads, args.head_dim, dtype=dtype, device=device)
    key = torch.randn(num_tokens, args.num_kv_heads, args.head_dim, dtype=dtype, device=device)
    value = torch.randn_like(key)
    scale = args.head_dim**-0.5

    def attend(backend) -> Callable[[], object]:
        return lambda: backend.forward(query, key, value, kv_cache, metadata, scale)

    if args.triton_configs:
        # Every tile shape must compute the same attention before its time counts.
        first = attend(backends[0])().float()
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        for backend in backends[1:]:
            torch.testing.assert_close(
                attend(backend)().float(), first, atol=tolerance, rtol=tolerance
            )

    # Interleaved rounds, so load from other processes hits every side alike.
    matmuls = layer_matmuls(args, num_tokens, dtype, device)
    attention_us: list[list[float]] = [[] for _ in backends]
    matmul_us = []
    before = cache_flusher() if args.cold else None
    for _ in range(args.rounds):
        for samples, backend in zip(attention_us, backends):
            samples.append(time_us(attend(backend), args.repeats, device, before))
        matmul_us.append(time_us(matmuls, args.repeats, device, before))
    return [statistics.median(s) for s in attention_us], statistics.median(matmul_us)


def make_backends(args, device: torch.device, dtype: torch.dtype) -> dict[str, object]:
    """Named backends to time: on CPU the torch backend without and with the compiled kernel."""
    kv_dtype = kv_cache_dtype(args, dtype)
    backend = select_backend(device, args.block_size, args.backend, dtype=dtype, kv_dtype=kv_dtype)
    on_cpu_kernel = isinstance(backend, TorchAttentionBackend) and device.type == "cpu"
    if args.cold and device.type != "cpu":
        raise SystemExit(f"--cold evicts the CPU's caches; it means nothing on {device.type}")
    if args.compare_kernel and not on_cpu_kernel:
        raise SystemExit(
            f"--compare-kernel times the compiled CPU kernel; {device.type} with the "
            f"{backend.name} backend does not run it"
        )
    if args.triton_configs:
        if backend.name != "triton":
            raise SystemExit(f"--triton-configs times the Triton kernel; this runs {backend.name}")
        configs = [KernelConfig.parse(text) for text in args.triton_configs.split(",") if text]
        backends = {"default": TritonAttentionBackend()}
        for text, config in zip(args.triton_configs.split(","), configs):
            backends[text] = TritonAttentionBackend(config)
        return backends
    if not on_cpu_kernel:
        return {backend.name: backend}
    if args.compare_amx:
        kernel = load_kernel(dtype, kv_dtype)
        if kernel is None or not kernel.amx:
            raise SystemExit(
                "--compare-amx needs the bfloat16 build on a host with AMX-BF16 (lscpu: "
                "amx_bf16), Linux 5.16 or later, and CONVEYOR_CPU_AMX unset"
            )
        return {"fma": AmxSwitched(kernel, False), "amx": AmxSwitched(kernel, True)}
    if args.compare_kernel:
        # Two versions of the kernel, interleaved: the sources in that folder, then this tree's.
        other, errors = load_kernel_from(args.compare_kernel, dtype, kv_dtype)
        if other is None or load_kernel(dtype, kv_dtype) is None:
            raise SystemExit("a kernel did not build:\n" + "\n".join(errors))
        backends = {"other kernel": TorchAttentionBackend()}
        backends["other kernel"].cpu_kernel = other
        backends["kernel"] = TorchAttentionBackend()
        return backends
    backends = {"torch ops": TorchAttentionBackend(use_cpu_kernel=False)}
    if load_kernel(dtype, kv_dtype) is not None:
        backends["kernel"] = TorchAttentionBackend()
    return backends


class AmxSwitched(TorchAttentionBackend):
    """The compiled kernel's backend with its AMX path turned on or off before each call."""

    def __init__(self, kernel, amx: bool) -> None:
        super().__init__()
        self.kernel, self.amx = kernel, amx

    def forward(self, *args, **kwargs):
        self.kernel.set_amx(self.amx)
        return super().forward(*args, **kwargs)


def kv_cache_dtype(args: argparse.Namespace, dtype: torch.dtype) -> torch.dtype:
    return dtype if args.kv_cache_dtype == "auto" else getattr(torch, args.kv_cache_dtype)


def describe_machine(device: torch.device) -> str:
    return ", ".join(f"{k}={v}" for k, v in machine_info(device=str(device)).items())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks attention", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="the cache's dtype (auto: --dtype's), as the engine's --kv-cache-dtype",
    )
    parser.add_argument("--backend", default=None, help="torch or flash-attn (default: auto)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--num-kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--intermediate-size", type=int, default=1536)
    parser.add_argument("--repeats", type=int, default=10, help="calls timed per round")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per side")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--query-lens", default="", help="comma-separated: time short prompt chunks instead"
    )
    parser.add_argument(
        "--chunk-lens", default="", help="comma-separated: time one prompt chunk of each length"
    )
    parser.add_argument(
        "--contexts", default="0", help="with --chunk-lens: cached tokens before the chunk"
    )
    parser.add_argument(
        "--compare-kernel",
        default=None,
        metavar="DIR",
        help="CPU: time the kernel built from the sources in DIR (another commit's "
        "worker/attention/csrc) against this tree's instead of the torch ops; the speed-up "
        "column is then theirs over ours",
    )
    parser.add_argument(
        "--compare-amx",
        action="store_true",
        help="CPU, bfloat16: time the kernel's AMX tile path against its FMA path, interleaved; "
        "the speed-up column is AMX's",
    )
    parser.add_argument(
        "--triton-configs",
        default="",
        metavar="CONFIGS",
        help="comma-separated ROWSxKEYS[/wWARPS][/sSTAGES] (e.g. 16x128/w4,64x64/w8/s3): time "
        "the Triton kernel with each tile shape beside its defaults (needs --backend triton); "
        "the speed-up column is the defaults' time over the last config's",
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="CPU: evict the caches before every timed call (inputs come from memory, as in a "
        "served step)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    backends = make_backends(args, device, dtype)
    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)
    print(f"machine: {describe_machine(device)}")
    print(
        f"config: {', '.join(backends)}, {args.dtype}, kv cache {kv_cache_dtype(args, dtype)}, "
        f"block_size {args.block_size}, "
        f"heads {args.num_heads}/{args.num_kv_heads} kv, head_dim {args.head_dim}, "
        f"hidden {args.hidden_size}, intermediate {args.intermediate_size}, "
        f"median of {args.rounds} x {args.repeats} calls"
    )
    names = list(backends)
    header = f"{'scenario':<28}{'tokens':>7}" + "".join(f"{' ' + n + ' us':>13}" for n in names)
    flops_header = "".join(f"{' ' + n + ' GF/s':>15}" for n in names) if len(names) > 1 else ""
    print(header + f"{'matmuls us':>12}{'attn/mm':>9}" + flops_header + f"{'speedup':>9}")
    query_lens, chunk_lens, contexts = (
        [int(q) for q in text.split(",") if q]
        for text in (args.query_lens, args.chunk_lens, args.contexts)
    )
    with torch.inference_mode():
        for scenario in make_scenarios(rng, query_lens, chunk_lens, contexts):
            attention_us, matmul_us = bench_scenario(
                args, scenario, list(backends.values()), rng, dtype, device
            )
            num_tokens = sum(scenario.num_scheduled)
            row = f"{scenario.name:<28}{num_tokens:>7}" + "".join(
                f"{t:>13.0f}" for t in attention_us
            )
            row += f"{matmul_us:>12.0f}{attention_us[-1] / matmul_us:>9.2f}"
            if len(names) > 1:
                flops = attention_flops(scenario, args.num_heads, args.head_dim)
                row += "".join(f"{flops / t / 1e3:>15.1f}" for t in attention_us)
                row += f"{attention_us[0] / attention_us[-1]:>9.2f}"
            print(row)
    return 0


def attention_flops(scenario: Scenario, num_heads: int, head_dim: int) -> float:
    """Multiply-adds x 2 of QK^T and PV over the keys each query row sees (causal)."""
    total = 0
    for computed, scheduled in zip(scenario.num_computed, scenario.num_scheduled):
        visible_keys = scheduled * computed + scheduled * (scheduled + 1) // 2
        total += 2 * 2 * visible_keys * num_heads * head_dim
    return float(total)


if __name__ == "__main__":
    sys.exit(main())
