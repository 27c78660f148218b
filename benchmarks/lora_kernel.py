"""What the LoRA correction costs per layer: the grouped kernel and the torch loop against the
base linears, one `bench`-model layer's four adapted linears at 64 rows.

Runs in this process on CPU. The step's 64 rows are spread evenly over 1, 4 and 16 rank-16
adapters on all seven projections. Before every call the caches are flushed by writing a buffer
larger than them, then the call's input rows and the base output are read back in (in a decode
step they were just written; the weights, base and adapter alike, arrive cold, because the
previous layer's weights went through the caches in between). The three ways are interleaved
call by call; each figure is the median over ``--repeats`` of a layer's four linears.
``--compare-build=FLAGS`` adds a build of the kernel with extra compiler flags (e.g.
``--compare-build=-DPREFETCH_B=0``) as a fourth way.

Then what swapping an adapter into a slot costs the step that needs it: ``LoRAManager`` on the
`bench` model with 16 slots fills one slot with a rank-16 adapter, from the host LRU and from
the adapter's files (medians of ``--repeats``; every slot was filled once before, as in a server
that has run a while). Usage::

    python -m benchmarks lora-kernel [--dtype float32] [--threads 1] [--repeats 40]
        [--compare-build=FLAGS] [--json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from conveyor.bench.machine import machine_info, print_report_start

HIDDEN, HEAD_DIM, HEADS, KV_HEADS, INTER = 512, 64, 8, 4, 1536  # the bench model's shapes
NUM_ROWS, RANK = 64, 16
FLUSH_BYTES = 64 << 20


def _layers(dtype: Any) -> list[tuple[Any, list[int]]]:
    from conveyor.worker.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )

    kv = KV_HEADS * HEAD_DIM
    return [
        (QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS), [HEADS * HEAD_DIM, kv, kv]),
        (RowParallelLinear(HEADS * HEAD_DIM, HIDDEN), [HIDDEN]),
        (MergedColumnParallelLinear(HIDDEN, [INTER, INTER]), [INTER, INTER]),
        (RowParallelLinear(INTER, HIDDEN), [HIDDEN]),
    ]


def _build(flags: str) -> Any:
    from conveyor.worker import native
    from conveyor.worker.lora import kernel

    compiler = native.find_compiler()
    if compiler is None:
        raise SystemExit("no C compiler: the kernel cannot be built")
    library, errors = native.build_and_load(
        kernel.SOURCE_PATH,
        [kernel.SOURCE_PATH],
        kernel._from_library,
        compiler,
        tuple(flags.split()),
    )
    if library is None:
        raise SystemExit("\n".join(errors))
    return library


def measure(args: argparse.Namespace, num_adapters: int) -> dict[str, float]:
    import numpy as np
    import torch

    from conveyor.worker.lora.slots import LoRASlots
    from conveyor.worker.lora.step_groups import StepGroups

    dtype = getattr(torch, args.dtype)
    flush = torch.zeros(FLUSH_BYTES // 4)
    other = _build(args.compare_build) if args.compare_build else None
    generator = torch.Generator().manual_seed(num_adapters)
    cases = []
    for layer, parts in _layers(dtype):
        layer.weight.data.normal_(generator=generator)
        layer.to(dtype)
        in_features = layer.weight.shape[1]
        groups = StepGroups()
        slots = LoRASlots(layer, len(parts), groups, 16, RANK, dtype, torch.device("cpu"))
        if slots.kernel is None:
            raise SystemExit("the grouped kernel is off or could not be built")
        for slot in range(num_adapters):
            slots.load(
                slot,
                {
                    p: (
                        torch.randn(RANK, in_features, generator=generator),
                        torch.randn(size, RANK, generator=generator),
                    )
                    for p, size in enumerate(parts)
                },
            )
        groups.set_tokens(np.repeat(np.arange(num_adapters), NUM_ROWS // num_adapters), "cpu")
        x = torch.randn(NUM_ROWS, in_features, generator=generator).to(dtype)
        out = torch.randn(NUM_ROWS, sum(parts), generator=generator).to(dtype)
        cases.append((layer, slots, x, out))
    kernel = cases[0][1].kernel
    ways = {
        "base": lambda layer, slots, x, out: layer.matmul(x, None),
        "kernel": lambda layer, slots, x, out: slots.add_to(x, out),
        "loop": lambda layer, slots, x, out: slots.add_with_torch(x, out),
    }
    if other is not None:

        def with_other(layer: Any, slots: Any, x: Any, out: Any) -> None:
            slots.kernel = other
            try:
                slots.add_to(x, out)
            finally:
                slots.kernel = kernel

        ways["other_build"] = with_other
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, call in ways.items():
            total = 0.0
            for layer, slots, x, out in cases:
                flush.add_(1.0)
                float(x.float().sum() + out.float().sum())
                start = time.perf_counter()
                call(layer, slots, x, out)
                total += time.perf_counter() - start
            times[name].append(total * 1e6)
    result = {f"{name}_us": statistics.median(values) for name, values in times.items()}
    for name in ways:
        if name != "base":
            pairs = [t / b for t, b in zip(times[name], times["base"])]
            result[f"{name}_vs_base"] = statistics.median(pairs)
    if other is not None:
        pairs = [o / k for o, k in zip(times["other_build"], times["kernel"])]
        result["other_build_vs_kernel"] = statistics.median(pairs)
    return result


def measure_fills(args: argparse.Namespace) -> dict[str, float]:
    import shutil
    import tempfile
    from pathlib import Path

    import torch

    from benchmarks.fixtures.model_maker import ensure_model
    from benchmarks.lora import make_adapters
    from conveyor.protocol.lora import LoRAConfig, LoRALoad
    from conveyor.worker.loader import load_model
    from conveyor.worker.lora import LoRAManager

    dtype = getattr(torch, args.dtype)
    model_dir = ensure_model("bench", "qwen3")
    work = Path(tempfile.mkdtemp(prefix="conveyor-bench-lora-fills-"))
    try:
        paths = [str(p) for p in make_adapters(str(model_dir), work, 2, RANK)]
        model = load_model(model_dir, dtype, "cpu")
        config = LoRAConfig(max_loras=16, max_lora_rank=RANK, max_cpu_loras=16)
        manager = LoRAManager(model, config, str(model_dir), dtype, torch.device("cpu"))
        for slot in range(16):
            manager.apply_loads([LoRALoad(slot, 100 + slot, paths[0])])
        files, host = [], []
        for i in range(args.repeats):
            manager._host.clear()  # read from the files again
            start = time.perf_counter()
            manager.apply_loads([LoRALoad(i % 16, 1, paths[1])])
            files.append(time.perf_counter() - start)
            start = time.perf_counter()
            manager.apply_loads([LoRALoad((i + 8) % 16, 1, paths[1])])
            host.append(time.perf_counter() - start)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "fill_from_files_ms": statistics.median(files) * 1e3,
        "fill_from_host_lru_ms": statistics.median(host) * 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks lora-kernel", description=__doc__)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--compare-build", default="", help="compiler flags of a second build")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    report = {
        "machine": machine_info(),
        "config": {
            "dtype": args.dtype,
            "threads": args.threads,
            "rows": NUM_ROWS,
            "rank": RANK,
            "repeats": args.repeats,
            "compare_build": args.compare_build,
        },
        "results": {str(n): measure(args, n) for n in (1, 4, 16)},
        "slot_fill": measure_fills(args),
    }
    if print_report_start(report, args.json):
        return 0
    print("a layer's four adapted linears, 64 rows, cold weights (medians, microseconds)")
    for count, row in report["results"].items():
        line = (
            f"{count:>2} adapters: base {row['base_us']:7.0f}  kernel {row['kernel_us']:6.0f}"
            f" ({row['kernel_vs_base']:.2f} of base)  loop {row['loop_us']:6.0f}"
            f" ({row['loop_vs_base']:.2f})"
        )
        if "other_build_us" in row:
            line += (
                f"  other build {row['other_build_us']:6.0f}"
                f" ({row['other_build_vs_kernel']:.2f}x the kernel)"
            )
        print(line)
    fill = report["slot_fill"]
    print(
        f"one slot filled (bench model, rank {RANK}, seven projections): from the host LRU"
        f" {fill['fill_from_host_lru_ms']:.1f} ms, from the adapter's files"
        f" {fill['fill_from_files_ms']:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
