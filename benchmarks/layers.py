"""Microbenchmarks of the model's token-wise ops on CPU: matmul kernels, norms, RoPE, SwiGLU.

    python -m benchmarks layers --model /tmp/bench2 --rows 1,16,64,256,2048
    python -m benchmarks layers --section model      # whole forward, attention stubbed out

Sections:
  matmul  every linear shape of the model at each row count: F.linear (MKL sgemm on W [out, in]),
          x @ W^T pre-transposed, oneDNN with the weight packed once (what the layers use for
          small batches), MKL packed for one exact batch size.
  ops     the small ops, the straightforward version (as Hugging Face writes them) against ours:
          residual add + RMSNorm, q/k head norms + RoPE, SiLU * up (each also as our torch ops,
          which the compiled CPU ops replace); with --compile also ours
          through torch.compile (static shapes, one compile per row count: minutes); with
          --device cuda the ops run on the GPU in bfloat16 (the other sections are CPU only);
          --dtype bfloat16 runs them in bfloat16 on CPU.
  int8    every decoder linear shape at each row count: float32 with the packed weight (what
          the layers use) against the weight-only int8 kernel (``--quantization int8``) and the
          4-bit one (``--quantization int4``, one scale per 64 inputs), each
          call on the next of enough copies of the weight (4x the last-level cache in int8,
          16x in float32) that it comes from memory, as in a forward pass of a model larger
          than the caches.
  small   every linear shape and the LM head at one to eight rows (a decode step of a few
          requests, or of one with its speculative positions), weights from memory (each call on the next of enough copies of the weight
          to fill 16x the last-level cache): oneDNN's packed weight against the compiled
          ``small_linear`` the layers use there. At one row a weight's float32 bytes are twice its
          GFLOP, so GB/s read = 2x the GFLOP/s printed.
  model   one forward with a stub attention that only copies q (so the time is everything but
          attention), decode-sized and prefill-sized, with and without packed weights, and the
          LM head on 64 rows. One decode row takes small_linear either way; "small_linear off"
          is the packed weight there, what it replaced.

Timings are the best of several interleaved rounds (variants alternate, so a burst of load from
another process hits them alike); the machine's cores are shared, so compare within a table.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from conveyor.worker.attention.backend import AttentionBackend
from conveyor.worker.attention.metadata_builder import build_attention_metadata
from conveyor.worker.layers import (
    RotaryEmbedding,
    SiluAndMul,
    gemm,
    normalize_and_rotate,
    rms_normalize,
    rotate_,
)
from conveyor.worker.layers.cpu_ops import SMALL_LINEAR_MAX_ROWS
from conveyor.worker.layers.gemm import pack_weight, packed_row_limit
from conveyor.worker.layers.norm import RMSNorm
from conveyor.worker.loader import load_model, read_hf_config
from conveyor.worker.worker import keep_freed_memory_in_heap

EPS = 1e-6


def best_of(
    variants: dict[str, Callable[[], object]],
    budget_s: float,
    sync: Callable[[], None] = lambda: None,
) -> dict[str, float]:
    """Seconds per call of each variant: the best of interleaved rounds within ~budget_s.
    ``sync`` drains an asynchronous device before each clock read (CUDA)."""
    for fn in variants.values():  # warm-up: first-call allocations, oneDNN kernel creation
        fn()
        fn()
    sync()
    start = time.perf_counter()
    for fn in variants.values():
        fn()
    sync()
    one_round = max(time.perf_counter() - start, 1e-6)
    calls = max(1, int(budget_s / 12 / one_round))
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(12):
        for name, fn in variants.items():
            sync()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            best[name] = min(best[name], (time.perf_counter() - start) / calls)
    return best


def print_row(label: str, times: dict[str, float], flops: float | None = None) -> None:
    fastest = min(times, key=times.get)
    cells = []
    for name, seconds in times.items():
        rate = f" {flops / seconds / 1e9:4.0f}GF" if flops else ""
        mark = "*" if name == fastest else " "
        cells.append(f"{name} {seconds * 1e6:9.1f}us{rate}{mark}")
    print(f"{label:22s} " + "  ".join(cells), flush=True)


def linear_shapes(config) -> dict[str, tuple[int, int]]:
    """name -> (in, out) of every matmul in one layer, and the LM head, on one rank."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    hidden, heads, kv_heads = (
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
    )
    return {
        "qkv": (hidden, (heads + 2 * kv_heads) * head_dim),
        "o": (heads * head_dim, hidden),
        "gate_up": (hidden, 2 * config.intermediate_size),
        "down": (config.intermediate_size, hidden),
        "lm_head": (hidden, config.vocab_size),
    }


def matmul_variants(x: torch.Tensor, weight: torch.Tensor) -> dict[str, Callable[[], object]]:
    weight_t, packed = weight.t().contiguous(), pack_weight(weight)
    variants: dict[str, Callable[[], object]] = {
        "F.linear": lambda: F.linear(x, weight),
        "x@W_t": lambda: x @ weight_t,
    }
    if packed is not None:
        variants["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(
            x, packed, None, "none", [], ""
        )
    if torch._C.has_mkl:
        num_rows = x.shape[0]
        mkl_packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, num_rows)
        variants["mkl(1 size)"] = lambda: torch.ops.mkl._mkl_linear(
            x, mkl_packed, weight, None, num_rows
        )
    return variants


def bench_matmuls(config, rows: list[int], budget_s: float) -> None:
    limit = packed_row_limit()
    used = "for every batch" if limit is None else f"for <= {limit} rows"
    print(f"\n== matmul (packed oneDNN is used {used} on this CPU) ==")
    for num_rows in rows:
        for name, (k, n) in linear_shapes(config).items():
            x, weight = torch.randn(num_rows, k), torch.randn(n, k) / k**0.5
            times = best_of(matmul_variants(x, weight), budget_s)
            print_row(f"M={num_rows:<5d} {name}", times, 2 * num_rows * k * n)


def in_turn(calls: list[Callable[[], object]]) -> Callable[[], object]:
    """One call of the next of ``calls`` each time, round and round."""
    turns = itertools.cycle(calls)
    return lambda: next(turns)()


def bench_int8(config, rows: list[int], budget_s: float) -> None:
    from benchmarks.attention import last_level_cache_bytes
    from conveyor.worker.layers.gemm import linear
    from conveyor.worker.layers.int8_linear import Int8Weight, load_int8_gemm
    from conveyor.worker.layers.quantization.int4_kernel import (
        Int4Panels,
        load_int4_gemm,
        quantize_int4,
    )

    gemm = load_int8_gemm()
    if gemm is None:
        print("\n== int8: the kernel is unavailable (no C compiler, or CONVEYOR_CPU_KERNEL=0) ==")
        return
    cache_bytes = last_level_cache_bytes() or 32 << 20  # where Linux reports none
    print(
        f"\n== int8 (weights from memory: int8 copies of 4x the {cache_bytes >> 20} MiB cache) =="
    )
    shapes = {name: shape for name, shape in linear_shapes(config).items() if name != "lm_head"}
    for name, (k, n) in shapes.items():
        # Sized by the int8 weights, the smaller: both sets then come from memory.
        copies = max(2, -(-4 * cache_bytes // (n * k)))
        weights = [torch.randn(n, k) / k**0.5 for _ in range(copies)]
        packed = [pack_weight(w) for w in weights]
        int8 = [Int8Weight(w, None) for w in weights]
        int4_gemm = load_int4_gemm()
        # 4-bit, one scale per 64 inputs (--quantization int4); the same copies, from memory too.
        int4 = (
            [Int4Panels(int4_gemm, *quantize_int4(w, 64), 64) for w in weights] if int4_gemm else []
        )
        for num_rows in rows:
            x = torch.randn(num_rows, k)
            float32 = [functools.partial(linear, x, w, None, p) for w, p in zip(weights, packed)]
            quantized = [functools.partial(q.linear, x) for q in int8]
            variants = {"float32": in_turn(float32), "int8": in_turn(quantized)}
            if int4:
                variants["int4"] = in_turn([functools.partial(q.linear, x, None) for q in int4])
            times = best_of(variants, budget_s)
            print_row(f"M={num_rows:<5d} {name}", times, 2 * num_rows * k * n)


def bench_small_linears(config, rows: list[int], budget_s: float) -> None:
    from benchmarks.attention import last_level_cache_bytes
    from conveyor.worker.layers.cpu_ops import load_token_ops

    ops = load_token_ops()
    if ops is None:
        print(
            "\n== small: the compiled ops are unavailable (no C compiler, or CONVEYOR_CPU_KERNEL=0) =="
        )
        return
    cache_bytes = last_level_cache_bytes() or 32 << 20  # where Linux reports none
    # A virtual machine may report its host's whole L3 (hundreds of MiB): 2 GiB of copies at most.
    budget_bytes = min(16 * cache_bytes, 2 << 30)
    print(
        f"\n== one to {SMALL_LINEAR_MAX_ROWS} rows (weights from memory: copies of up to 16x the "
        f"{cache_bytes >> 20} MiB cache, {budget_bytes >> 20} MiB at most) =="
    )
    for name, (k, n) in linear_shapes(config).items():
        copies = max(2, -(-budget_bytes // (4 * n * k)))
        weights = [torch.randn(n, k) / k**0.5 for _ in range(copies)]
        packed = [pack_weight(w) for w in weights]
        for num_rows in rows:
            x = torch.randn(num_rows, k)
            onednn = [
                functools.partial(torch.ops.mkldnn._linear_pointwise, x, p, None, "none", [], "")
                for p in packed
            ]
            compiled = [functools.partial(ops.small_linear, x, w, None) for w in weights]
            variants = {"onednn": in_turn(onednn), "small_linear": in_turn(compiled)}
            print_row(f"M={num_rows:<5d} {name}", best_of(variants, budget_s), 2 * num_rows * k * n)


def reference_add_norm(x, residual, weight):
    """Hugging Face's RMSNorm after the residual add, op by op."""
    x = x + residual
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + EPS)).to(x.dtype), x


def reference_qk_norm_rope(qkv, q_size, kv_size, head_dim, q_weight, k_weight, rope, positions):
    """Per-head norms of q and k apart, then RoPE with a table lookup per call (per layer)."""
    num_tokens = qkv.shape[0]
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    outputs = []
    cos, sin = rope.cos_sin(positions)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    for x, weight in ((q, q_weight), (k, k_weight)):
        x = x.reshape(num_tokens, -1, head_dim)
        x32 = x.float()
        x = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        outputs.append(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))
    return outputs[0], outputs[1], v


def ours_qk_norm_rope(qkv, q_size, kv_size, head_dim, qk_weight, angles):
    """What the decoder layer runs: one compiled pass in place where it can (CPU)."""
    qk = qkv[:, : q_size + kv_size].view(qkv.shape[0], -1, head_dim)
    qk = normalize_and_rotate(qk, qk_weight, EPS, angles)
    num_heads = q_size // head_dim
    return qk[:, :num_heads], qk[:, num_heads:], qkv[:, q_size + kv_size :]


def torch_qk_norm_rope(qkv, q_size, kv_size, head_dim, qk_weight, angles):
    """The layer's torch ops, which the compiled pass replaces on CPU (float32, bfloat16)."""
    qk = qkv[:, : q_size + kv_size].view(qkv.shape[0], -1, head_dim)
    qk = rotate_(rms_normalize(qk, qk_weight, EPS), angles)
    num_heads = q_size // head_dim
    return qk[:, :num_heads], qk[:, num_heads:], qkv[:, q_size + kv_size :]


class OpCases:
    """The small ops of one layer of ``config``, reference and ours (and ours compiled), at a
    given row count."""

    def __init__(
        self,
        config,
        compile_ops: bool = False,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.device, self.dtype = torch.device(device), dtype
        hidden = config.hidden_size
        self.head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        self.q_size = config.num_attention_heads * self.head_dim
        self.kv_size = config.num_key_value_heads * self.head_dim
        self.inter = config.intermediate_size
        self.rope = RotaryEmbedding.from_config(config, self.head_dim).to(device)
        self.norm = RMSNorm(hidden, EPS).to(device, dtype)
        self.q_weight, self.k_weight = (
            torch.rand(self.head_dim, device=device, dtype=dtype) for _ in range(2)
        )
        heads, kv_heads = self.q_size // self.head_dim, self.kv_size // self.head_dim
        self.qk_weight = torch.cat(
            [self.q_weight.expand(heads, -1), self.k_weight.expand(kv_heads, -1)]
        )
        self.act = SiluAndMul()
        self.compiled = None
        if compile_ops:
            # Static shapes: the best case for generated kernels (no shape guards in them).
            self.compiled = {
                "add+rmsnorm": torch.compile(self.norm.forward, dynamic=False),
                "qk norm+rope": torch.compile(ours_qk_norm_rope, dynamic=False),
                "silu*up": torch.compile(self.act.forward, dynamic=False),
            }

    def at(self, num_rows: int) -> dict[str, dict[str, Callable[[], object]]]:
        like = {"device": self.device, "dtype": self.dtype}
        x = torch.randn(num_rows, self.norm.weight.shape[0], **like)
        residual = torch.randn_like(x)
        qkv = torch.randn(num_rows, self.q_size + 2 * self.kv_size, **like)
        positions = torch.randint(
            0, min(self.rope.num_positions, 4096), (num_rows,), device=self.device
        )
        gate_up = torch.randn(num_rows, 2 * self.inter, **like)
        sizes = (self.q_size, self.kv_size, self.head_dim)

        def rope_with(function):
            def run():
                # The angles are looked up once per step, not per layer: 1/num_layers of it here.
                angles = self.rope.angles(positions, qkv.dtype)
                return function(qkv, *sizes, self.qk_weight, angles)

            return run

        weights = (self.q_weight, self.k_weight, self.rope, positions)
        cases = {
            "add+rmsnorm": {
                "reference": lambda: reference_add_norm(x, residual, self.norm.weight),
                # The layer's torch ops, which "ours" runs as one compiled op on CPU.
                "torch ops": lambda: rms_normalize(x + residual, self.norm.weight, EPS),
                "ours": lambda: self.norm(x, residual),
            },
            "qk norm+rope": {
                "reference": lambda: reference_qk_norm_rope(qkv, *sizes, *weights),
                # In place on qkv, as in the layer: timing only, the values drift.
                "torch ops": rope_with(torch_qk_norm_rope),
                "ours": rope_with(ours_qk_norm_rope),
            },
            "silu*up": {
                "reference": lambda: F.silu(gate_up[:, : self.inter]) * gate_up[:, self.inter :],
                "torch ops": lambda: F.silu(gate_up[:, : self.inter]).mul_(
                    gate_up[:, self.inter :]
                ),
                "ours": lambda: self.act(gate_up),
            },
        }
        if self.compiled is not None:
            compiled = self.compiled

            def compiled_rope():
                angles = self.rope.angles(positions, qkv.dtype)
                return compiled["qk norm+rope"](qkv, *sizes, self.qk_weight, angles)

            cases["add+rmsnorm"]["compiled"] = lambda: compiled["add+rmsnorm"](x, residual)
            cases["qk norm+rope"]["compiled"] = compiled_rope
            cases["silu*up"]["compiled"] = lambda: compiled["silu*up"](gate_up)
        return cases


def bench_ops(
    config,
    rows: list[int],
    budget_s: float,
    compile_ops: bool = False,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
) -> None:
    on_cuda = device == "cuda"
    dtype = dtype or (torch.bfloat16 if on_cuda else torch.float32)
    print(f"\n== small ops: reference (HF-style) vs ours, {device}, {dtype} ==")
    cases = OpCases(config, compile_ops, device, dtype)
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    for num_rows in rows:
        for name, variants in cases.at(num_rows).items():
            print_row(f"M={num_rows:<5d} {name}", best_of(variants, budget_s, sync))


class CopyAttention(AttentionBackend):
    """Stands in for attention: returns a copy of the queries, writes no cache."""

    name = "copy"

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int):
        return (0,)

    def forward(self, query, key, value, kv_cache, metadata, scale, *window_sinks_softcap):
        return query.clone()


def step_inputs(num_tokens: int, num_reqs: int, vocab_size: int):
    query_lens = np.full(num_reqs, num_tokens // num_reqs)
    metadata, positions = build_attention_metadata(
        query_lens, np.full(num_reqs, 100), np.zeros((num_reqs, 64), np.int32), 16, "cpu"
    )
    last_rows = torch.from_numpy(np.cumsum(query_lens) - 1)
    return (
        torch.randint(0, vocab_size, (num_tokens,)),
        torch.from_numpy(positions),
        metadata,
        last_rows,
    )


class StubbedModel:
    """The bench model with attention replaced by CopyAttention; packed weights switchable."""

    def __init__(self, model_dir: str) -> None:
        self.model = load_model(model_dir, torch.float32, "cpu")
        for layer in self.model.attention_layers():
            layer.backend, layer.kv_cache = CopyAttention(), torch.empty(0)
        self.packed = {
            module: module.packed_weight
            for module in self.model.modules()
            if getattr(module, "packed_weight", None) is not None
        }

    def set_packed(self, on: bool) -> None:
        for module, weight in self.packed.items():
            module.packed_weight = weight if on else None

    def forward(self, inputs: tuple, packed: bool, output_rows=None) -> torch.Tensor:
        self.set_packed(packed)
        return self.model(*inputs, output_rows)

    def forward_without_small_linear(self, inputs: tuple) -> torch.Tensor:
        """The packed weight's forward where one or two rows would take small_linear."""
        self.set_packed(True)
        limit = gemm.SMALL_LINEAR_MAX_ROWS
        gemm.SMALL_LINEAR_MAX_ROWS = 0
        try:
            return self.model(*inputs)
        finally:
            gemm.SMALL_LINEAR_MAX_ROWS = limit

    def logits(self, hidden: torch.Tensor, packed: bool) -> torch.Tensor:
        self.set_packed(packed)
        return self.model.compute_logits(hidden)

    def step_variants(self, num_tokens: int, num_reqs: int) -> dict[str, Callable[[], object]]:
        ids, positions, metadata, last_rows = step_inputs(
            num_tokens, num_reqs, self.model.config.vocab_size
        )
        inputs = (ids, positions, metadata)
        variants = {
            "packed off": lambda: self.forward(inputs, False),
            "packed on": lambda: self.forward(inputs, True),
        }
        if num_tokens <= SMALL_LINEAR_MAX_ROWS:  # both above ran small_linear: what it replaced
            variants["small_linear off"] = lambda: self.forward_without_small_linear(inputs)
        if num_tokens > num_reqs:  # rows that are not sampled: only the last of each request is
            variants["+output_rows"] = lambda: self.forward(inputs, True, last_rows)
        return variants


def bench_model(model_dir: str, budget_s: float) -> None:
    print("\n== model forward, attention stubbed out (copies q) ==")
    stubbed = StubbedModel(model_dir)
    for label, num_tokens, num_reqs in (
        ("decode 1x1", 1, 1),
        ("decode 64x1", 64, 64),
        ("prefill 16x128", 2048, 16),
    ):
        print_row(label, best_of(stubbed.step_variants(num_tokens, num_reqs), budget_s * 4))
    hidden = torch.randn(64, stubbed.model.config.hidden_size)
    variants = {
        "packed off": lambda: stubbed.logits(hidden, False),
        "packed on": lambda: stubbed.logits(hidden, True),
    }
    print_row("lm head 64 rows", best_of(variants, budget_s))
    stubbed.set_packed(True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks layers", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default="/tmp/bench2", help="a model directory (config.json)")
    parser.add_argument(
        "--rows",
        default=None,
        help="comma-separated row counts (default 1,16,64,256,2048; the small section: 1-8, and "
        "it takes no other)",
    )
    parser.add_argument(
        "--section", choices=("all", "matmul", "ops", "int8", "small", "model"), default="all"
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--budget", type=float, default=0.5, help="seconds per measurement")
    parser.add_argument(
        "--compile", action="store_true", help="ops section: also ours through torch.compile"
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="ops section: where they run"
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="ops section: the activations' dtype (default float32 on CPU, bfloat16 on CUDA)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    keep_freed_memory_in_heap()  # as the worker does: no page faults on reused buffers
    config = read_hf_config(Path(args.model))
    rows = [int(r) for r in (args.rows or "1,16,64,256,2048").split(",")]
    small_rows = list(range(1, SMALL_LINEAR_MAX_ROWS + 1))
    if args.section == "small" and args.rows:
        small_rows = rows
        if not all(1 <= r <= SMALL_LINEAR_MAX_ROWS for r in rows):
            parser.error(
                f"--section small times 1 to {SMALL_LINEAR_MAX_ROWS} rows (what small_linear "
                f"takes), not --rows {args.rows}"
            )
    print(f"torch {torch.__version__}, {args.threads} threads, model {args.model}")
    with torch.inference_mode():
        if args.section in ("all", "matmul"):
            bench_matmuls(config, rows, args.budget)
        if args.section in ("all", "ops"):
            dtype = getattr(torch, args.dtype) if args.dtype else None
            bench_ops(config, rows, args.budget, args.compile, args.device, dtype)
        if args.section in ("all", "int8"):
            bench_int8(config, rows, args.budget)
        if args.section in ("all", "small"):
            bench_small_linears(config, small_rows, args.budget)
        if args.section in ("all", "model"):
            bench_model(args.model, args.budget)
    return 0


if __name__ == "__main__":
    sys.exit(main())
