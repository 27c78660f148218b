"""Batch-1 decode on CPU: float32 against ``--quantization int8`` and ``int4``, interleaved.

    python -m benchmarks quantized-decode --size qwen3-0.6b --rounds 3 --output-len 64
    python -m benchmarks quantized-decode --size qwen3-0.6b --linears --rounds 5
    python -m benchmarks quantized-decode --size qwen3-0.6b --linears --rows 1,8,64,256

Runs in the process the developer starts. Builds one in-process engine per weight format on the
same random-weight model (Qwen3-0.6B's shapes by default: big enough that reading the weights,
not Python, bounds a step), then, round after round, has each generate one request greedily;
prints each format's best output tok/s, its decode step time, and the step's weight-read time:
the bytes a decode step reads (every decoder linear in its format, the float32 LM head, one
embedding row) over the host's read bandwidth, measured here by torch.mv over a 1 GiB matrix.
Other processes sharing the cores move all three alike; the ratios are of one run.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import torch


def read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second a matrix-vector product reads a float32 matrix far larger than the
    caches at (best of ``repeats``): what a decode step's linears can at best do."""
    rows = 8192
    matrix = torch.randn(rows, num_bytes // 4 // rows)
    vector = torch.randn(matrix.shape[1])
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mv(matrix, vector)
        best = min(best, time.perf_counter() - start)
    return matrix.nbytes / best


def decode_bytes(config: dict, name: str) -> float:
    """What one decode step reads of the weights in format ``name``: every decoder linear in
    that format (int8: a byte a weight and a float32 scale a row; int4: half a byte, a float32
    scale and a float32 zero offset per 64 inputs), the LM head (in the same format: int4 and
    int8 quantize it too), one embedding row and the norms; the KV cache of a short request is
    left out."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]
    per_weight = {"float32": 4.0, "int8": 1.0, "int4": 0.5 + 8 / 64}[name]
    linears = (
        sum(n * k * per_weight + (4 * n if name == "int8" else 0) for n, k in shapes)
        * config["num_hidden_layers"]
    )
    head = config["vocab_size"] * (hidden * per_weight + (4 if name == "int8" else 0))
    return linears + head + 4 * hidden * (2 * config["num_hidden_layers"] + 2)


def _int4_linear(amx: bool, panels, x: torch.Tensor) -> torch.Tensor:
    panels.gemm.set_amx(amx)
    return panels.linear(x, None)


def time_linears(
    config: dict,
    copies_bytes: int,
    repeats: int,
    rows: int = 1,
    int8_group: int = 0,
    fp8: bool = False,
) -> None:
    """Each decoder linear shape at ``rows`` rows, float32 (oneDNN's packed weight, what the
    layers run) against the int8 and int4 kernels, on enough copies of the weight
    (``copies_bytes`` of float32) that each call reads its weight from memory; on a host where
    the 4-bit kernel has its AMX path, int4 with it ("int4") and without ("int4 avx": the 6-row
    tile, from 256 rows the float32 weight and torch's GEMM); where the int8 kernel has its
    VNNI path, W8A8 (int8 weights, activations rounded to int8 per row) through it ("w8a8") and
    through torch as it ran before that path ("w8a8 torch": the weight dequantized at every call,
    the rounded activations multiplied in float32); with ``int8_group``, group-wise 8-bit
    weights (GPTQ 8-bit: a scale per ``int8_group`` inputs) through the kernel ("int8 gN") and
    dequantized at every call in torch ("int8 gN torch", the path before the kernel took them);
    with ``fp8``, Qwen3-FP8's block-wise FP8 through the FP8 kernel ("fp8", AVX512-BF16, on AMX
    tiles from 8 rows where the host has them; "fp8 tile" without them) and the torch path
    ("fp8 torch").
    All interleaved, best of ``repeats`` passes over the copies."""
    from conveyor.worker.layers.gemm import linear, pack_weight
    from conveyor.worker.layers.int8_linear import (
        Int8Weight,
        W8A8Weight,
        load_int8_gemm,
        quantize_int8,
    )
    from conveyor.worker.layers.quantization.fp8_kernel import load_fp8_gemm
    from conveyor.worker.layers.quantization.int4_kernel import (
        Int4Panels,
        load_int4_gemm,
        quantize_int4,
    )

    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"qkv": (q + 2 * kv, hidden), "o": (hidden, q), "gate_up": (2 * inter, hidden),
              "down": (hidden, inter)}  # fmt: skip
    gemm = load_int4_gemm()
    amx = gemm.amx
    vnni = load_int8_gemm().w8a8
    formats = ["float32", "int8", "int4", *(["int4 avx"] if amx else [])]
    formats += ["w8a8", "w8a8 torch"] if vnni else []
    grouped = f"int8 g{int8_group}"
    formats += [grouped, f"{grouped} torch"] if int8_group else []
    fp8_gemm = load_fp8_gemm() if fp8 else None
    formats += ["fp8", "fp8 torch"] if fp8_gemm else []
    fp8_amx = bool(fp8_gemm and fp8_gemm.amx)
    formats += ["fp8 tile"] if fp8_amx else []
    print(f"rows {rows}; int4 {'with' if amx else 'without'} the AMX path"
          + ("; W8A8 through VNNI" if vnni else ""))  # fmt: skip
    print(f"{'linear':>8} " + " ".join(f"{f + ' us':>11}" for f in formats)
          + f" {'int4 GB/s':>9} {'int4/int8':>9} {'int4/f32':>8}"
          + (f" {'amx/avx':>8}" if amx else "")
          + (f" {'w8a8/f32':>8} {'w8a8/torch':>10}" if vnni else ""))  # fmt: skip
    for name, (n, k) in shapes.items():
        count = max(2, copies_bytes // (4 * n * k))
        weights = [torch.randn(n, k) / k**0.5 for _ in range(count)]
        float32 = [(w, pack_weight(w)) for w in weights]
        int8 = [Int8Weight(w, None) for w in weights]
        int4 = [Int4Panels(gemm, *quantize_int4(w, 64), 64) for w in weights]
        quantized8 = [quantize_int8(w) for w in weights] if vnni else []
        w8a8 = [W8A8Weight(load_int8_gemm(), q, scale, False) for q, scale in quantized8]
        # The checkpoint layout the torch path reads: codes + 128 as bytes, a scale per row.
        stored = [((q.to(torch.int16) + 128).to(torch.uint8), scale) for q, scale in quantized8]
        del quantized8
        by_group = [_grouped8(w, int8_group) for w in weights] if int8_group else []
        fp8_weights = [_blockwise_fp8(fp8_gemm, w) for w in weights] if fp8_gemm else []
        del weights
        x = torch.randn(rows, k)
        calls = {
            "float32": [functools.partial(linear, x, w, None, p) for w, p in float32],
            "int8": [functools.partial(q8.linear, x) for q8 in int8],
            "int4": [functools.partial(_int4_linear, amx, q4, x) for q4 in int4],
        }
        if amx:
            calls["int4 avx"] = [functools.partial(_int4_linear, False, q4, x) for q4 in int4]
        if vnni:
            calls["w8a8"] = [functools.partial(w.linear, x, None) for w in w8a8]
            calls["w8a8 torch"] = [functools.partial(_w8a8_torch, *c, x) for c in stored]
        if fp8_gemm:
            calls["fp8"] = [functools.partial(p.linear, x, None) for p, _ in fp8_weights]
            calls["fp8 torch"] = [functools.partial(_fp8_torch, *t, x) for _, t in fp8_weights]
        if fp8_amx:
            calls["fp8"] = [functools.partial(_fp8_linear, True, p, x) for p, _ in fp8_weights]
            calls["fp8 tile"] = [
                functools.partial(_fp8_linear, False, p, x) for p, _ in fp8_weights
            ]
        if int8_group:
            calls[grouped] = [functools.partial(g.linear, x, False) for g, _ in by_group]
            calls[f"{grouped} torch"] = [
                functools.partial(_grouped8_torch, *t, int8_group, x) for _, t in by_group
            ]
        best = {v: float("inf") for v in calls}
        for _ in range(repeats):
            for v, each in calls.items():
                start = time.perf_counter()
                for call in each:
                    call()
                best[v] = min(best[v], (time.perf_counter() - start) / count)
        gemm.set_amx(amx)
        if fp8_amx:
            fp8_gemm.set_amx(True)
        int4_bytes = int4[0].nbytes
        us = {v: t * 1e6 for v, t in best.items()}
        print(
            f"{name:>8} " + " ".join(f"{us[f]:11.1f}" for f in formats)
            + f" {int4_bytes / best['int4'] / 1e9:9.1f} {best['int8'] / best['int4']:9.2f}"
            + f" {best['float32'] / best['int4']:8.2f}"
            + (f" {best['int4 avx'] / best['int4']:8.2f}" if amx else "")
            + (f" {best['float32'] / best['w8a8']:8.2f} {best['w8a8 torch'] / best['w8a8']:10.2f}"
               if vnni else "")
        )  # fmt: skip


def _blockwise_fp8(gemm, weight: torch.Tensor):
    """(the kernel's FP8Panels, (codes e4m3, per-row block scales)) of Qwen3-FP8's layout: a
    scale per 128 x 128 block, activations rounded per 128 features of a token."""
    from conveyor.worker.layers.quantization.fp8_kernel import FP8Panels

    n, k = weight.shape
    blocks = weight.view(n // 128, 128, k // 128, 128).abs().amax(dim=(1, 3)) / 448
    scales = blocks.repeat_interleave(128, dim=0)  # [N, K / 128], as the loader spreads them
    codes = (weight / scales.repeat_interleave(128, dim=1)).to(torch.float8_e4m3fn)
    return FP8Panels(gemm, codes, scales, 128, "group"), (codes, scales)


def _fp8_linear(amx: bool, panels, x: torch.Tensor) -> torch.Tensor:
    panels.gemm.set_amx(amx)
    return panels.linear(x, None)


def _fp8_torch(codes, scales, x: torch.Tensor) -> torch.Tensor:
    """Block-wise FP8 as the torch path runs it: dequantized at every call, the activations
    rounded through FP8 per 128 features and multiplied in float32."""
    from conveyor.worker.layers.quantization.activations import fake_quantize

    weight = codes.to(torch.float32) * scales.repeat_interleave(128, dim=1)
    return fake_quantize(x, "float8", "group", 128) @ weight.T


def _grouped8(weight: torch.Tensor, group: int):
    """(the kernel's Int8Weight, (codes uint8, scales) as the checkpoint layout holds them) of
    a symmetric 8-bit quantization with one scale per ``group`` inputs."""
    from conveyor.worker.layers.int8_linear import Int8Weight

    n, k = weight.shape
    grouped = weight.view(n, k // group, group)
    scales = grouped.abs().amax(-1) / 127
    q = torch.round(grouped / scales[..., None]).clamp(-127, 127).to(torch.int8).view(n, k)
    codes = (q.to(torch.int16) + 128).to(torch.uint8)
    return Int8Weight.from_grouped(q, scales, None, group), (codes, scales)


def _grouped8_torch(codes, scales, group: int, x: torch.Tensor) -> torch.Tensor:
    """Group-wise 8-bit as the torch path ran it: dequantized at every call."""
    groups = torch.arange(codes.shape[1]) // group
    return x @ ((codes.to(torch.float32) - 128) * scales[:, groups]).T


def _w8a8_torch(codes: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """W8A8 as the torch path runs it without the kernel (quantization/weights.py): the weight
    dequantized at every call, the rounded activations multiplied in float32."""
    from conveyor.worker.layers.quantization.activations import fake_quantize

    weight = (codes.to(torch.float32) - 128) * scale[:, None]
    return fake_quantize(x, "int", "token") @ weight.T


def _checkpoint(spec: str, model_dir: str) -> tuple[str, Path]:
    """--checkpoint NAME=DIR, or NAME=compressed-tensors:PRESET (made from the model)."""
    from benchmarks.fixtures.quantized_maker import ensure_quantized

    name, _, where = spec.partition("=")
    if not name or not where:
        raise SystemExit(f"--checkpoint takes NAME=DIR, not {spec!r}")
    kind, _, preset = where.partition(":")
    if kind == "compressed-tensors" and preset:
        return name, ensure_quantized(Path(model_dir), kind, preset=preset, group=0)
    if where == "fp8":  # Qwen3-FP8's layout: 128 x 128 weight blocks, 128-feature activations
        return name, ensure_quantized(Path(model_dir), "fp8")
    return name, Path(where)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.fixtures.model_maker import ensure_model
    from conveyor.bench.machine import machine_info
    from conveyor.frontend import LLM
    from conveyor.protocol import SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="qwen3-0.6b")
    parser.add_argument("--model", help="a model directory in place of --size's random model")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--formats", default="float32,int8,int4")
    parser.add_argument(
        "--linears", action="store_true", help="time each decoder linear at one row instead"
    )
    parser.add_argument("--copies-mb", type=int, default=512, help="--linears: float32 MB")
    parser.add_argument("--rows", default="1", help="--linears: row counts, comma-separated")
    parser.add_argument(
        "--int8-group", type=int, default=0,
        help="--linears: also group-wise 8-bit weights with this group size",
    )  # fmt: skip
    parser.add_argument("--fp8", action="store_true", help="--linears: also block-wise FP8 weights")
    parser.add_argument(
        "--checkpoint", action="append", default=[], metavar="NAME=DIR",
        help="also a quantized checkpoint as it loads (its format from its config), "
        "named NAME in the table; 'NAME=compressed-tensors:PRESET' or 'NAME=fp8' (Qwen3-FP8's "
        "block-wise layout) makes one from the model",
    )  # fmt: skip
    args = parser.parse_args(argv)
    model_dir = args.model or str(ensure_model(args.size, "qwen3"))
    bandwidth = read_bandwidth()
    if args.linears:
        print("machine:", ", ".join(f"{k}={v}" for k, v in machine_info().items()))
        print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s (torch.mv over a 1 GiB float32 matrix)")
        config = json.loads((Path(model_dir) / "config.json").read_text())
        for rows in (int(r) for r in args.rows.split(",")):
            time_linears(config, args.copies_mb << 20, args.rounds, rows, args.int8_group, args.fp8)
        return 0
    engines = {}
    for name in args.formats.split(","):
        quantization = None if name == "float32" else name
        engines[name] = LLM(
            model_dir, engine="inprocess", device="cpu", dtype="float32", quantization=quantization,
            max_num_seqs=1, kv_cache_memory=256 << 20, enable_prefix_caching=False,
        )  # fmt: skip
    config = json.loads((Path(model_dir) / "config.json").read_text())
    weights = {name: decode_bytes(config, name) for name in engines}
    for name, directory in (_checkpoint(spec, model_dir) for spec in args.checkpoint):
        engines[name] = LLM(
            str(directory), engine="inprocess", device="cpu", dtype="float32", max_num_seqs=1,
            kv_cache_memory=256 << 20, enable_prefix_caching=False,
        )  # fmt: skip
        # What a step reads: every stored tensor (the embedding through the tied LM head).
        weights[name] = sum(f.stat().st_size for f in Path(directory).glob("*.safetensors"))
    prompt = [list(range(10, 10 + args.prompt_len))]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    best: dict[str, float] = {name: 0.0 for name in engines}
    for llm in engines.values():  # warm-up: kernels built, caches touched
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    for _ in range(args.rounds):
        for name, llm in engines.items():
            start = time.perf_counter()
            llm.generate(prompt, params, use_tqdm=False)
            best[name] = max(best[name], args.output_len / (time.perf_counter() - start))
    print("machine:", ", ".join(f"{k}={v}" for k, v in machine_info().items()))
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s (torch.mv over a 1 GiB float32 matrix)")
    print(f"{'format':>8} {'tok/s':>7} {'step ms':>8} {'weights MB':>11} {'read ms':>8} "
          f"{'step/read':>9} {'vs float32':>10}")  # fmt: skip
    for name in engines:
        step_ms = 1e3 / best[name]
        read_ms = weights[name] / bandwidth * 1e3
        ratio = best[name] / best["float32"] if "float32" in best else float("nan")
        print(
            f"{name:>8} {best[name]:7.1f} {step_ms:8.2f} {weights[name] / 1e6:11.1f} "
            f"{read_ms:8.2f} {step_ms / read_ms:9.2f} {ratio:10.2f}"
        )
    for llm in engines.values():
        llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
