"""Compile every Triton kernel of conveyor for a Hopper GPU (sm_90) on a machine without one.

    python scripts/compile_triton_sm90.py [--json]

Triton's interpreter (the CPU tests) runs a kernel's source with numpy and never meets the
compiler: a kernel it takes can still fail to compile, or ask for more shared memory than a GPU
has, and that would show only on a GPU machine. Triton's own compiler and the ptxas it bundles
build the same kernels for ``GPUTarget("cuda", 90, 32)`` here: the attention kernel in each dtype
with the decode, split-K, prompt and long-chunk shapes, windows, soft-caps and sinks; its merge
and cache-write kernels; the token ops and the LoRA correction's two kernels in bfloat16, float16
and float32; the quantized linears' GEMM for each weight layout and activation kind. One line
per variant (with ``--json``, one JSON object); exit status 1 if any failed. Must run without
TRITON_INTERPRET=1, which makes the kernels interpreted functions.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# What an H100's or H200's block may use (227 KiB).
SM90_SHARED_BYTES = 232_448


def _paged_signature(dtype: str) -> dict[str, str]:
    data = "*" + dtype
    signature = dict.fromkeys(["q_ptr", "k_ptr", "v_ptr", "out_ptr", "sinks_ptr"], data)
    for name in ("block_table_ptr", "seq_lens_ptr", "query_start_ptr", "tile_req_ptr"):
        signature[name] = "*i32"
    signature |= {"tile_start_ptr": "*i32", "part_ptr": "*fp32", "ml_ptr": "*fp32"}
    signature |= {"scale": "fp32", "softcap": "fp32", "window": "i32", "num_heads": "i32"}
    signature |= dict.fromkeys(["stride_qt", "stride_qh", "stride_ot", "stride_oh"], "i32")
    signature |= {"stride_kh": "i64", "stride_kb": "i64", "stride_ks": "i32", "stride_bt": "i32"}
    return signature


def variants():
    """(name, kernel, signature, constexprs, options) for every variant compiled."""
    from conveyor.worker.attention import triton_kernel as attention
    from conveyor.worker.layers import triton_token_kernels as ops

    shapes = [
        ("decode", "bf16", 16, 64, 1, "", {}),
        ("small decode, split-K", "bf16", 16, 64, 16, "sinks", {}),
        ("prompt chunks, every feature", "bf16", 64, 64, 1, "window softcap sinks", {}),
        ("long chunks", "bf16", 128, 128, 1, "", {"num_warps": 8, "num_stages": 3}),
        ("head_dim 256, split-K", "fp16", 16, 32, 8, "window", {}),
        # float32 prompt tiles compile for ~20 s (ieee dots): a decode's shape stands in.
        ("float32 decode, split-K", "fp32", 16, 64, 4, "softcap", {}),
    ]
    for name, dtype, rows, keys, segments, features, options in shapes:
        head_dim = 256 if keys == 32 else 128
        constexprs = {"GROUP": 2, "ROWS": rows, "KEYS": keys, "HEAD_DIM": head_dim}
        constexprs |= {"HEAD_DIM_PAD": head_dim, "BLOCK_SIZE": 16, "SEGMENTS": segments}
        constexprs |= {f"USE_{f.upper()}": f in features for f in ("window", "softcap", "sinks")}
        constexprs["PRECISION"] = "ieee" if dtype == "fp32" else "tf32"
        signature = _paged_signature(dtype)
        yield (
            f"paged_attention: {name} ({dtype})",
            attention.paged_attention,
            signature,
            constexprs,
            options,
        )
    for sinks in (False, True):
        signature = {"part_ptr": "*fp32", "ml_ptr": "*fp32", "out_ptr": "*bf16"}
        signature |= {"sinks_ptr": "*bf16", "stride_ot": "i32", "stride_oh": "i32"}
        constexprs = {"SEGMENTS": 16, "HEAD_DIM": 128, "HEAD_DIM_PAD": 128, "USE_SINKS": sinks}
        yield (
            f"reduce_segments (sinks {sinks})",
            attention.reduce_segments,
            signature,
            constexprs,
            {},
        )
    strides = ["stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_ch", "stride_cs"]
    signature = dict.fromkeys(["key_ptr", "value_ptr", "k_ptr", "v_ptr"], "*bf16")
    signature |= {"slot_ptr": "*i64", "stride_cb": "i64"} | dict.fromkeys(strides, "i32")
    constexprs = {"HEAD_DIM": 128, "HEAD_DIM_PAD": 128, "BLOCK_SIZE": 16}
    yield "store_kv", attention.store_kv, signature, constexprs, {}
    for dtype in ("bf16", "fp16", "fp32"):
        data = "*" + dtype
        signature = dict.fromkeys(["qk_ptr", "weight_ptr", "cos_ptr", "sin_ptr"], data)
        signature |= dict.fromkeys(["stride_t", "stride_h", "stride_ct", "stride_st"], "i32")
        constexprs = {"HEAD_DIM": 128, "HALF": 32, "BLOCK_HALF": 32, "REST": 64}
        constexprs |= {"BLOCK_REST": 64, "HAS_WEIGHT": True}
        yield (
            f"qk_norm_rope ({dtype})",
            ops.qk_norm_rope,
            signature | {"eps": "fp32"},
            constexprs,
            {"num_warps": 1},
        )
        signature = dict.fromkeys(
            ["x_ptr", "residual_ptr", "weight_ptr", "out_ptr", "sum_ptr"], data
        )
        signature |= dict.fromkeys(["stride_x", "stride_r", "stride_o", "stride_s"], "i32")
        constexprs = {"SIZE": 1024, "BLOCK": 1024, "HAS_RESIDUAL": True}
        yield (
            f"add_rms_norm ({dtype})",
            ops.add_rms_norm,
            signature | {"eps": "fp32"},
            constexprs,
            {},
        )
        signature = {"x_ptr": data, "out_ptr": data, "stride_x": "i32", "stride_o": "i32"}
        yield (
            f"silu_and_mul ({dtype})",
            ops.silu_and_mul,
            signature,
            {"SIZE": 3072, "BLOCK": 1024},
            {},
        )
    # The LoRA correction (worker/lora/triton_lora.py): slots of rank 64 over a fused qkv.
    from conveyor.worker.lora import triton_lora
    from conveyor.worker.lora import triton_lora_kernels as lora

    for dtype in ("bf16", "fp16", "fp32"):
        data = "*" + dtype
        signature = {"x_ptr": data, "a_ptr": data, "slots_ptr": "*i32", "out_ptr": "*fp32"}
        signature |= dict.fromkeys(["stride_x", "stride_as", "stride_ak", "stride_o"], "i32")
        signature |= {"K": "i32", "W": "i32"}
        constexprs = {"BLOCK_K": triton_lora.BLOCK_K, "BLOCK_W": 256}
        yield f"lora_shrink ({dtype})", lora.shrink, signature, constexprs, {}
        signature = {"shrunk_ptr": "*fp32", "b_ptr": data, "slots_ptr": "*i32", "out_ptr": data}
        signature |= dict.fromkeys(["stride_s", "stride_bs", "stride_bw", "stride_o"], "i32")
        signature |= {"N": "i32", "W": "i32"}
        constexprs = {"BLOCK_W": 256, "BLOCK_N": triton_lora.BLOCK_N}
        yield f"lora_expand ({dtype})", lora.expand, signature, constexprs, {}
    yield from _quant_gemm_variants()


def _quant_gemm_variants():
    """The quantized linears' GEMM (worker/layers/quantization/triton_quant.py): each weight
    layout and activation kind at the decode, middle and prompt tiles ``tile_for`` picks."""
    from conveyor.worker.layers.quantization import triton_quant
    from conveyor.worker.layers.quantization import triton_quant_kernels as quant

    # (name, activations, output, bits, fp8 weights, zeros, gather, scaled activations, rows)
    cases = [
        ("w4 groups", "bf16", "bf16", 4, False, False, False, False, 1),
        ("w4 zeros, act-order", "bf16", "bf16", 4, False, True, True, False, 4096),
        ("w4 zeros", "fp16", "fp16", 4, False, True, False, False, 48),
        ("w8 per row", "bf16", "bf16", 8, False, False, False, False, 4096),
        ("fp8 blocks", "bf16", "bf16", 8, True, False, False, False, 4096),
        ("int8 x int8 codes", "fp16", "bf16", 8, False, False, False, True, 4096),
        ("fp8 x fp8 codes", "fp16", "fp32", 8, True, False, False, True, 8),
        ("w4 float32", "fp32", "fp32", 4, False, True, False, False, 4096),
        ("fp8 float32, act-order tile", "fp32", "fp32", 8, True, False, True, False, 4096),
    ]
    for name, x_dtype, out_dtype, bits, float8, zeros, gather, scaled, rows in cases:
        signature = {"x_ptr": "*" + x_dtype, "x_scales_ptr": "*fp32", "codes_ptr": "*u8"}
        signature |= {"scales_ptr": "*fp32", "zeros_ptr": "*fp32", "g_idx_ptr": "*i32"}
        signature |= {"bias_ptr": "*" + out_dtype, "out_ptr": "*" + out_dtype}
        strides = ["stride_xm", "stride_xsm", "stride_xsg", "stride_cn", "stride_sn"]
        signature |= dict.fromkeys(["M", "N", "K", *strides, "stride_zn", "stride_om"], "i32")
        signature |= {"group_size": "i32", "x_group_size": "i32", "zero_point": "fp32"}
        block_m, block_n, warps = triton_quant.tile_for(rows)
        constexprs = {"W_BITS": bits, "W_FLOAT8": float8, "HAS_ZEROS": zeros, "GATHER": gather}
        constexprs |= {"X_SCALED": scaled, "HAS_BIAS": True}
        constexprs["PRECISION"] = "ieee" if x_dtype == "fp32" else "tf32"
        constexprs |= {"BLOCK_M": block_m, "BLOCK_N": block_n}
        constexprs["BLOCK_K"] = triton_quant.BLOCK_KS[0]
        yield (
            f"quant_gemm: {name}, {rows} rows ({x_dtype})",
            quant.quant_gemm,
            signature,
            constexprs,
            {"num_warps": warps},
        )


def compile_for_sm90(kernel, signature: dict, constexprs: dict, options: dict) -> int:
    """Compile ``kernel`` for sm_90; the shared memory it needs, in bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    given = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    if set(given) != set(kernel.arg_names):
        raise ValueError(
            f"arguments differ from the kernel's: {set(given) ^ set(kernel.arg_names)}"
        )
    ordered = {name: given[name] for name in kernel.arg_names}
    source = ASTSource(fn=kernel, signature=ordered, constexprs=constexprs)
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, **options}
    )
    return compiled.metadata.shared


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object per variant")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    failed = 0
    for name, kernel, signature, constexprs, options in variants():
        result = {"kernel": name}
        try:
            shared = compile_for_sm90(kernel, signature, constexprs, options)
            result |= {"ok": shared <= SM90_SHARED_BYTES, "shared_bytes": shared}
            if not result["ok"]:
                result["error"] = (
                    f"needs {shared} bytes of shared memory, sm_90 has {SM90_SHARED_BYTES}"
                )
        except Exception as error:  # noqa: BLE001 - reported per variant, the rest still built
            result |= {"ok": False, "error": f"{type(error).__name__}: {str(error)[-500:]}"}
        failed += not result["ok"]
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            status = f"ok, {result['shared_bytes']:,} B shared" if result["ok"] else result["error"]
            print(f"{name}: {status}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
