"""What serving LoRA adapters costs: output tokens per second of one batch spread over 1, 4 and
16 adapters, against the same batch on the base model.

Runs ``LLM`` (engine-core process + worker) with ``enable_lora`` on one model and makes
``max(--adapters)`` PEFT adapters of ``--rank`` on every q/k/v/o and gate/up/down projection
(random A and B, saved by PEFT). Each batch is ``--num-requests`` random-token prompts, greedy
with ``ignore_eos``, interleaved round after round (every other round in reverse order) so their
ratios come from one machine state; a ratio to the base is the median over rounds of that
round's pair:

- ``base``: no adapter (the engine's LoRA path is skipped for a step without one);
- ``loras-N``: request i runs under adapter i mod N (every step mixes N adapters).

Prefix caching is off, so every batch computes its prompts. The engine's step trace gives each
decode step's duration: ``loras-16``'s against ``loras-1``'s is what mixing adapters in one
step costs over one adapter.

``--compare-loop`` starts a second engine whose workers run the torch loop over the step's
adapters (``CONVEYOR_LORA_KERNEL=0``) instead of the grouped kernel, and interleaves its batches
with the first's round by round: ``kernel/loop``, the ratio of the two engines' median rates,
is the kernel's gain in one machine state. ``--compare-eager`` (CUDA only: the CPU never
captures graphs) likewise starts an engine with ``enforce_eager`` beside the first, whose decode
steps replay CUDA graphs with the adapters' Triton kernels inside: ``graphs/eager`` is what the
graphs gain on LoRA batches (the ratio of median rates, as ``kernel/loop``). Usage::

    python -m benchmarks lora [--model DIR] [--dtype float32] [--engine mp] [--num-requests 64]
        [--output-len 64] [--rank 16] [--adapters 1 4 16] [--rounds 3] [--compare-loop]
        [--compare-eager] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from conveyor.bench.machine import machine_info, print_report_start

PROMPT_LEN = 32
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


_VARIANTS = {
    "kernel": "in one grouped kernel call per layer on CPU (where it builds), two Triton "
    "launches on CUDA (decode steps in CUDA graphs)",
    "loop": "in a torch loop, two matmuls per adapter per layer (CONVEYOR_LORA_KERNEL=0)",
    "eager": "in the kernels, every step eager (enforce_eager: no CUDA graphs)",
}


def _paired(rates: list[float], against: list[float]) -> float:
    """The median over rounds of one round's rate against the other's in the same round."""
    return statistics.median(a / b for a, b in zip(rates, against))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def make_adapters(model: str, folder: Path, count: int, rank: int) -> list[Path]:
    from benchmarks.fixtures.lora_maker import make_adapter

    return [
        make_adapter(Path(model), folder / f"adapter-{i}", rank, TARGETS, seed=i)
        for i in range(count)
    ]


def _start_engine(model: str, args: argparse.Namespace, trace: Path, variant: str) -> Any:
    """An engine for the batches; ``loop``: its workers run the torch loop (the variable is
    read when the worker processes start, so it is set around the start only); ``eager``: no
    CUDA graphs."""
    from conveyor.frontend import LLM
    from conveyor.worker.lora.kernel import KERNEL_ENV, kernel_enabled

    before = os.environ.get(KERNEL_ENV)
    os.environ[KERNEL_ENV] = "0" if variant == "loop" else "1"
    kernel_enabled.cache_clear()  # an in-process worker reads it in this process
    try:
        return LLM(
            model,
            engine=args.engine,
            executor_backend=args.engine,
            dtype=args.dtype,
            max_num_seqs=max(64, args.num_requests),
            enable_lora=True,
            max_loras=max(args.adapters),
            max_lora_rank=args.rank,
            enable_prefix_caching=False,
            trace_steps=str(trace),
            enforce_eager=variant == "eager",
        )
    finally:
        if before is None:
            del os.environ[KERNEL_ENV]
        else:
            os.environ[KERNEL_ENV] = before
        kernel_enabled.cache_clear()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.fixtures.model_maker import ensure_model
    from conveyor.protocol import SamplingParams
    from conveyor.protocol.lora import LoRARequest

    model = str(args.model or ensure_model("bench", "qwen3"))
    work = Path(tempfile.mkdtemp(prefix="conveyor-bench-lora-"))
    most = max(args.adapters)
    paths = make_adapters(model, work, most, args.rank)
    adapters = [LoRARequest(f"adapter-{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    rng = random.Random(0)
    variants = ["kernel"] + ["loop"] * args.compare_loop + ["eager"] * args.compare_eager
    traces = {variant: work / f"steps-{variant}.jsonl" for variant in variants}
    engines: dict[str, Any] = {}
    batches: dict[str, list[LoRARequest | None]] = {"base": [None] * args.num_requests}
    for count in args.adapters:
        batches[f"loras-{count}"] = [adapters[i % count] for i in range(args.num_requests)]
    rates: dict[tuple[str, str], list[float]] = {}
    steps: dict[tuple[str, str], list[float]] = {}
    try:
        for variant in variants:
            engines[variant] = _start_engine(model, args, traces[variant], variant)
        vocab_size = engines["kernel"].config.model.vocab_size
        greedy = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

        def prompts() -> list[list[int]]:
            return [
                [rng.randrange(10, vocab_size) for _ in range(PROMPT_LEN)]
                for _ in range(args.num_requests)
            ]

        for llm in engines.values():  # warm-up: kernels built, every adapter loaded
            llm.generate(prompts(), greedy, use_tqdm=False, lora_request=batches[f"loras-{most}"])
        for round_index in range(args.rounds):
            # Every other round runs in reverse order, so drift in the machine's state within a
            # round does not favour whichever batch comes first.
            order = [(v, name) for v in variants for name in batches]
            for variant, name in order[:: -1 if round_index % 2 else 1]:
                llm, trace = engines[variant], traces[variant]
                num_lines = len(trace.read_text().splitlines()) if trace.exists() else 0
                start = time.perf_counter()
                outputs = llm.generate(
                    prompts(), greedy, use_tqdm=False, lora_request=batches[name]
                )
                elapsed = time.perf_counter() - start
                num_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
                assert num_tokens == args.num_requests * args.output_len, num_tokens
                rates.setdefault((variant, name), []).append(num_tokens / elapsed)
                lines = trace.read_text().splitlines()[num_lines:]
                records = [json.loads(line) for line in lines]
                steps.setdefault((variant, name), []).extend(
                    r["duration_ms"] for r in records if r["num_prefill_tokens"] == 0
                )
    finally:
        for llm in engines.values():
            llm.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    results = {variant: _summary(rates, steps, variant, batches, args) for variant in variants}
    for other, key in (("loop", "kernel_vs_loop"), ("eager", "graphs_vs_eager")):
        if other in results:
            for name, row in results["kernel"].items():
                row[key] = row["output_tok_per_s"] / results[other][name]["output_tok_per_s"]
    return {
        "machine": machine_info(),
        "config": {
            "model": model,
            "dtype": args.dtype,
            "engine": args.engine,
            "num_requests": args.num_requests,
            "prompt_len": PROMPT_LEN,
            "output_len": args.output_len,
            "rank": args.rank,
            "targets": TARGETS,
            "rounds": args.rounds,
        },
        "results": results,
    }


def _summary(
    rates: dict[tuple[str, str], list[float]],
    steps: dict[tuple[str, str], list[float]],
    variant: str,
    batches: dict[str, Any],
    args: argparse.Namespace,
) -> dict[str, dict[str, float]]:
    base = rates[(variant, "base")]
    one = _percentile(steps[(variant, f"loras-{min(args.adapters)}")], 0.5)
    return {
        name: {
            "output_tok_per_s": statistics.median(rates[(variant, name)]),
            "vs_base": _paired(rates[(variant, name)], base),
            "step_p50_ms": _percentile(steps[(variant, name)], 0.5),
            "step_p50_vs_fewest": _percentile(steps[(variant, name)], 0.5) / one,
        }
        for name in batches
    }


# The ratios of the first engine's rates to another's in the same rounds, and their columns.
_RATIOS = {"kernel_vs_loop": "kernel/loop", "graphs_vs_eager": "graphs/eager"}


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks lora", description=__doc__)
    parser.add_argument("--model", type=Path, help="model directory (default: the bench model)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--engine",
        default="mp",
        choices=["mp", "inprocess"],
        help="mp: engine and worker processes; inprocess: both in this process (no heartbeats "
        "to miss on a host that stalls for seconds)",
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--compare-loop",
        action="store_true",
        help="also run an engine on the torch loop (CONVEYOR_LORA_KERNEL=0), interleaved",
    )
    parser.add_argument(
        "--compare-eager",
        action="store_true",
        help="CUDA only: also run an engine with enforce_eager (no CUDA graphs), interleaved",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    if args.compare_eager and not _has_cuda():
        parser.error("--compare-eager needs a CUDA device: the CPU never captures CUDA graphs")
    report = run(args)
    if print_report_start(report, args.json):
        return 0
    for variant, rows in report["results"].items():
        print(f"{variant}: the step's adapters {_VARIANTS[variant]}")
        ratios = [key for key in _RATIOS if key in rows["base"]]
        print(
            f"{'batch':<9} {'out tok/s':>10} {'vs base':>8} {'step p50':>10} {'vs fewest':>10}"
            + "".join(f" {_RATIOS[key]:>14}" for key in ratios)
        )
        for name, row in rows.items():
            gain = "".join(f" {row[key]:>13.2f}x" for key in ratios)
            print(
                f"{name:<9} {row['output_tok_per_s']:>10.0f} {row['vs_base']:>7.2f}x"
                f" {row['step_p50_ms']:>8.1f}ms {row['step_p50_vs_fewest']:>9.2f}x{gain}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
