"""What a quantized linear's matmul costs on CUDA: the Triton kernel (or ``torch._scaled_mm``)
against the torch path it replaces (the weight dequantized to float32 per call) and a bfloat16
linear of the same shape, interleaved.

    python -m benchmarks quant-gemm [--shape 4096x4096] [--rows 1,16,256,4096] [--repeats 50]
        [--json]

Runs in this process, on a CUDA GPU only (refused elsewhere: the kernels run on CUDA alone).
Each scheme gets random codes, scales and zeros of the shape (out x in); activations are
bfloat16. Per row count the three ways are called in turn, call after call, each timed with
CUDA events; the table gives each way's median and the same-run ratios kernel/bf16 and
torch/kernel (above 1: the kernel is faster than the torch path).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from conveyor.bench.machine import machine_info, print_report_start


def _schemes() -> dict[str, Any]:
    from conveyor.worker.layers.quantization.scheme import (
        FLOAT8,
        INT,
        ActivationScheme,
        LinearScheme,
        WeightScheme,
    )

    return {
        "w4a16 g128": LinearScheme(WeightScheme(INT, 4, group_size=128)),
        "w4a16 g128 zeros act-order": LinearScheme(
            WeightScheme(INT, 4, group_size=128, symmetric=False, act_order=True)
        ),
        "w8a16 per row": LinearScheme(WeightScheme(INT, 8)),
        "fp8 blocks, bf16 activations": LinearScheme(
            WeightScheme(FLOAT8, 8, group_size=128, block_rows=128)
        ),
        "w8a8 int8 per token": LinearScheme(WeightScheme(INT, 8), ActivationScheme(INT, "token")),
        "fp8 w8a8 per token": LinearScheme(
            WeightScheme(FLOAT8, 8), ActivationScheme(FLOAT8, "token")
        ),
    }


def random_weights(scheme: Any, out_features: int, in_features: int, device: Any) -> Any:
    """A ``QuantizedWeights`` of random codes, scales, zeros and act-order on ``device``."""
    import torch

    from conveyor.worker.layers.quantization.packing import pack_nibbles
    from conveyor.worker.layers.quantization.weights import QuantizedWeights

    quant = QuantizedWeights(
        scheme, out_features, in_features, lambda shard: out_features, lambda *args: None
    )
    w = scheme.weights
    if w.kind == "int":
        codes = torch.randint(0, 1 << w.bits, (out_features, in_features))
        quant.codes.data = pack_nibbles(codes) if w.bits == 4 else codes.to(torch.uint8)
    else:
        quant.codes.data = (torch.randn(out_features, in_features) * 40).to(torch.float8_e4m3fn)
    quant.scales.data = torch.rand_like(quant.scales) * 0.02 + 0.005
    if not w.symmetric:
        quant.zeros.data = torch.randint(0, 1 << w.bits, quant.zeros.shape).float()
    if w.act_order:
        order = torch.randperm(in_features)
        quant.g_idx.data = (torch.arange(in_features) // w.group_size)[order].to(torch.int32)
    return quant.to(device)


def _time(ways: dict[str, Any], repeats: int) -> dict[str, float]:
    """Median milliseconds per call of each way, the ways interleaved call by call."""
    import torch

    for call in ways.values():  # compiled and warm before timing
        call()
    events = {name: [] for name in ways}
    for _ in range(repeats):
        for name, call in ways.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {
        name: statistics.median(s.elapsed_time(e) for s, e in pairs)
        for name, pairs in events.items()
    }


def run(shape: tuple[int, int], rows: list[int], repeats: int) -> list[dict[str, Any]]:
    import torch

    from conveyor.worker.layers.quantization import triton_quant

    out_features, in_features = shape
    device = torch.device("cuda")
    dense = torch.randn(out_features, in_features, device=device, dtype=torch.bfloat16)
    results = []
    for name, scheme in _schemes().items():
        quant = random_weights(scheme, out_features, in_features, device)
        quant.process_weights_after_loading()  # the kernels' plan, as after a checkpoint loads
        plan = quant.kernel_plan
        if plan is None:
            raise SystemExit(f"no kernel plan ({triton_quant.unavailable_reason()})")
        for num_rows in rows:
            x = torch.randn(num_rows, in_features, device=device, dtype=torch.bfloat16)

            def torch_path(quant=quant, x=x, plan=plan):
                quant.kernel_plan = None
                quant.linear(x, None)
                quant.kernel_plan = plan

            ways = {
                "kernel": lambda quant=quant, x=x, plan=plan: triton_quant.linear(
                    quant, plan, x, None
                ),
                "bf16": lambda x=x: torch.nn.functional.linear(x, dense),
                "torch": torch_path,
            }
            ms = _time(ways, repeats)
            results.append(
                {
                    "scheme": name,
                    "rows": num_rows,
                    "scaled_mm": plan.scaled_mm,
                    **{f"{way}_ms": round(t, 4) for way, t in ms.items()},
                    "kernel_over_bf16": round(ms["kernel"] / ms["bf16"], 3),
                    "torch_over_kernel": round(ms["torch"] / ms["kernel"], 3),
                }
            )
        if triton_quant.failure is not None:
            raise SystemExit(f"a kernel launch failed: {triton_quant.failure}")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4096x4096", help="out x in features")
    parser.add_argument("--rows", default="1,16,256,4096", help="comma-separated row counts")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        parser.error("quant-gemm times the CUDA kernels; this machine has no CUDA GPU")
    shape = tuple(int(n) for n in args.shape.split("x"))
    rows = [int(n) for n in args.rows.split(",") if n]
    report: dict[str, Any] = {
        "machine": machine_info(),
        "config": {"shape": args.shape, "rows": rows, "repeats": args.repeats, "x": "bfloat16"},
    }
    report["results"] = run(shape, rows, args.repeats)
    if print_report_start(report, args.json):
        return 0
    print(f"{'scheme':30} {'rows':>5} {'kernel ms':>10} {'kernel/bf16':>12} {'torch/kernel':>13}")
    for r in report["results"]:
        name = r["scheme"] + (" (_scaled_mm)" if r["scaled_mm"] else "")
        print(
            f"{name:30} {r['rows']:>5} {r['kernel_ms']:>10.4f} {r['kernel_over_bf16']:>12.3f} "
            f"{r['torch_over_kernel']:>13.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
