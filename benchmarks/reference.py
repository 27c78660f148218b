"""conveyor against the reference engine (vLLM's CPU build), side by side in one invocation.

    python -m benchmarks reference --model DIR --workloads equal,mix,long --pairs 3

Runs in the benchmark's own process; conveyor is the multi-process engine of `bench offline`
(same workloads, prompts, warm-up and timed run), the reference engine a child process under its
own Python (`benchmarks/reference_engine.py`; scripts/install_reference_engine.sh installs it)
that gets the very same token ids through a temporary JSON file. Both: greedy, ignore_eos, the
same max_tokens, max 64 sequences, a 2048-token budget, float32, prefix caching on (each
engine's default; the prompts are random, so nothing hits). Per workload both engines start and
warm up on the same warm-up prompts, then run alternately (conveyor, reference, conveyor, ...)
`--pairs` times, each pair on new prompts, so drift on a shared host hits both alike; each run
reports what the idle engine burnt meanwhile (`idle_peer_cpu`, cores). Per pair:
output and total tok/s of each, the ratio (conveyor over reference: both produce the same tokens,
so it is the ratio of their times), and each one's share of the compute roofline
(`benchmarks/roofline.py`) against the matmul calibration measured in the same run. Per
workload: the medians, and the ratio an engine at 100 % of the roofline would reach (the
reciprocal of the reference's share): a ratio goal above it asks for more than the host's
matmul speed.
Under CONVEYOR_CPU_ISA=avx2 both engines run what an AVX2-only CPU runs (runtime/cpu_isa.py,
reference_client.isa_env); the report's machine line names it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.reference_client import ReferenceEngine
from benchmarks.roofline import DenseShapes, batch_flops, roofline_share
from conveyor.bench.machine import Timing, machine_info, print_report_start, tree_cpu_seconds
from conveyor.bench.offline import (
    WORKLOADS,
    engine_kwargs,
    make_requests,
    measure_matmul_gflops,
    start_llm,
    timed_requests,
    timed_run,
)
from conveyor.frontend.engine_args import EngineArgs, add_engine_args

DEFAULT_REFERENCE_PYTHON = Path.home() / ".cache/conveyor-ref/vllmcpu/bin/python"
# (timed requests, warm-up requests) per workload: `long`'s prompts are 2,000-4,000 tokens.
WORKLOAD_SIZES: dict[str, tuple[int, int]] = {"equal": (64, 8), "mix": (64, 8), "long": (16, 2)}
# Pause before each timed run: vLLM's worker busy-polls its input for 1 s after its last step,
# which would otherwise take most of a core from the start of conveyor's next run.
SETTLE_S = 2.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks reference", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--workloads", default="equal,mix,long", help="comma-separated (also: uneven)"
    )
    parser.add_argument("--pairs", type=int, default=3, help="(conveyor, reference) runs each")
    parser.add_argument("--num-requests", type=int, help="default: 64, long 16")
    parser.add_argument("--num-warmup-requests", type=int, help="default: 8, long 2")
    parser.add_argument(
        "--reference-python",
        default=os.environ.get("CONVEYOR_REFERENCE_PYTHON", str(DEFAULT_REFERENCE_PYTHON)),
        help="the Python of the reference engine's venv (env CONVEYOR_REFERENCE_PYTHON)",
    )
    parser.add_argument("--json", action="store_true", help="print the whole report as JSON")
    add_engine_args(parser)
    parser.set_defaults(max_num_seqs=64, max_num_batched_tokens=2048, dtype="float32")
    args = parser.parse_args(argv)
    if args.quantization is not None:
        # The reference engine would run the checkpoint's float weights: not the same model.
        parser.error("--quantization: the reference engine runs the same weights unquantized")
    for flag in ("tensor_parallel_size", "data_parallel_size", "nnodes"):
        # The reference engine runs one worker on this host; more on conveyor's side only
        # would not be a side-by-side.
        if getattr(args, flag) != 1:
            parser.error(f"--{flag.replace('_', '-')}: the reference engine runs one worker here")
    unknown = set(args.workloads.split(",")) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads {sorted(unknown)}; choose from {sorted(WORKLOADS)}")
    return args


def workload_sizes(args: argparse.Namespace, workload: str) -> tuple[int, int]:
    num_requests, num_warmup = WORKLOAD_SIZES.get(workload, (64, 8))
    if args.num_requests is not None:
        num_requests = args.num_requests
    if args.num_warmup_requests is not None:
        num_warmup = args.num_warmup_requests
    return num_requests, num_warmup


def summarize(run: dict[str, object], flops: int, calibration: float) -> dict[str, object]:
    """A run's rates from its token counts and seconds, plus its roofline share."""
    seconds = float(run["seconds"])
    num_output, num_prompt = int(run["num_output_tokens"]), int(run["num_prompt_tokens"])
    return {
        **run,
        "output_tok_s": round(num_output / seconds, 1),
        "total_tok_s": round((num_output + num_prompt) / seconds, 1),
        "roofline": round(roofline_share(flops, seconds, calibration), 3),
    }


def pair_result(conveyor: dict[str, object], reference: dict[str, object]) -> dict[str, object]:
    """One pair; the ratio is of total tok/s (equal to output tok/s's when the tokens match)."""
    ratio = float(conveyor["total_tok_s"]) / float(reference["total_tok_s"])
    return {"conveyor": conveyor, "reference": reference, "ratio": round(ratio, 3)}


def workload_summary(pairs: list[dict[str, object]]) -> dict[str, object]:
    """Medians over the pairs: the ratio the issue's goals are stated in, and the roofline."""
    return {
        "median_ratio": round(statistics.median(float(p["ratio"]) for p in pairs), 3),
        "median_conveyor_roofline": round(
            statistics.median(float(p["conveyor"]["roofline"]) for p in pairs), 3
        ),
        "median_reference_roofline": round(
            statistics.median(float(p["reference"]["roofline"]) for p in pairs), 3
        ),
        # The ratio an engine at 100 % of the roofline would reach against the reference: what
        # a ratio goal asks of the host. It is the reciprocal of the reference's share.
        "ratio_at_roofline": round(
            statistics.median(1 / float(p["reference"]["roofline"]) for p in pairs), 3
        ),
    }


def run_reference(reference: ReferenceEngine, prompts, params) -> dict[str, object]:
    """A timed reference run; `idle_peer_cpu`: what conveyor's idle processes burnt meanwhile."""
    time.sleep(SETTLE_S)
    before = tree_cpu_seconds() - tree_cpu_seconds(reference.pid)
    with Timing() as timing:
        run = reference.generate(prompts, [p.max_tokens for p in params])
    idle = tree_cpu_seconds() - tree_cpu_seconds(reference.pid) - before
    load = timing.summary()
    return {
        **run,
        "other_load": load["other_load"],
        "idle_peer_cpu": round(idle / timing.seconds, 3),
    }


def run_conveyor(llm, args: argparse.Namespace, reference_pid: int, repeat: int):
    """bench offline's timed run; `idle_peer_cpu`: what the idle reference engine burnt."""
    time.sleep(SETTLE_S)
    before = tree_cpu_seconds(reference_pid)
    run = timed_run(llm, args, progress=False, repeat=repeat)
    idle = tree_cpu_seconds(reference_pid) - before
    return {**run, "idle_peer_cpu": round(idle / float(run["seconds"]), 3)}


def bench_workload(
    args: argparse.Namespace, engine_args: EngineArgs, workload: str
) -> dict[str, object]:
    """Both engines on one workload: start, warm up alike, calibrate, then the pairs."""
    num_requests, num_warmup = workload_sizes(args, workload)
    run_args = argparse.Namespace(workload=workload, num_requests=num_requests)
    llm = start_llm(engine_args, workload, num_warmup, engine="mp")
    model_dir = llm.config.model.model  # resolved: a hub id becomes its cached snapshot
    shapes = DenseShapes.from_model_dir(model_dir)
    try:
        reference = ReferenceEngine.start(
            args.reference_python, reference_flags(engine_args, model_dir)
        )
    except BaseException:
        llm.shutdown()
        raise
    try:
        vocab_size = min(len(llm.get_tokenizer()), llm.config.model.vocab_size)
        reference.generate(*_as_reference(*make_requests(workload, num_warmup, vocab_size, 1)))
        calibration = measure_matmul_gflops()
        pairs = []
        for repeat in range(args.pairs):
            prompts, params = timed_requests(llm, workload, num_requests, repeat)
            flops = batch_flops(shapes, [len(p) for p in prompts], [p.max_tokens for p in params])
            ours = summarize(run_conveyor(llm, run_args, reference.pid, repeat), flops, calibration)
            theirs = summarize(run_reference(reference, prompts, params), flops, calibration)
            pairs.append(pair_result(ours, theirs))
            _progress(workload, repeat, pairs[-1])
    finally:
        llm.shutdown()
        reference.close()
    return {
        "workload": workload,
        "num_requests": num_requests,
        "calibration_gflops": calibration,
        "reference_version": reference.version,
        **workload_summary(pairs),
        "pairs": pairs,
    }


def _as_reference(prompts, params) -> tuple[list[list[int]], list[int]]:
    return prompts, [p.max_tokens for p in params]


def reference_flags(engine_args: EngineArgs, model_dir: str) -> list[str]:
    """The reference engine's settings, taken from conveyor's so the two cannot drift apart."""
    return [
        f"--model={model_dir}",
        f"--max-num-seqs={engine_args.max_num_seqs}",
        f"--max-num-batched-tokens={engine_args.max_num_batched_tokens}",
        f"--dtype={engine_args.dtype}",
        f"--kv-cache-dtype={engine_args.kv_cache_dtype}",
        f"--prefix-caching={'on' if engine_args.enable_prefix_caching else 'off'}",
        f"--seed={engine_args.seed}",
    ]


def _progress(workload: str, repeat: int, pair: dict[str, object]) -> None:
    ours, theirs = pair["conveyor"], pair["reference"]
    print(
        f"[{workload} pair {repeat + 1}] conveyor {ours['total_tok_s']} total tok/s, "
        f"reference {theirs['total_tok_s']}: {pair['ratio']}x",
        file=sys.stderr,
        flush=True,
    )


def print_table(report: dict[str, object]) -> None:
    header = "workload pair | conveyor out/total tok/s | reference out/total tok/s | ratio"
    print(header + " | conveyor roofline | reference roofline | other load c/r | idle peer c/r")
    for result in report["workloads"]:
        for i, pair in enumerate(result["pairs"], 1):
            c, r = pair["conveyor"], pair["reference"]
            print(
                f"{result['workload']:>8} {i:>4} | {c['output_tok_s']:>9} / {c['total_tok_s']:<9}"
                f" | {r['output_tok_s']:>9} / {r['total_tok_s']:<9} | {pair['ratio']:>5}"
                f" | {c['roofline']:>6.1%} | {r['roofline']:>6.1%}"
                f" | {c['other_load']} / {r['other_load']}"
                f" | {c['idle_peer_cpu']} / {r['idle_peer_cpu']}"
            )
        print(
            f"{result['workload']:>8} median ratio {result['median_ratio']}x, conveyor at "
            f"{result['median_conveyor_roofline']:.1%} of the roofline (reference "
            f"{result['median_reference_roofline']:.1%}), calibration "
            f"{result['calibration_gflops']} GFLOP/s, reference vllm {result['reference_version']}"
        )
        print(
            f"{'':>8} at 100 % of the roofline an engine would be {result['ratio_at_roofline']}x "
            f"the reference here; the median ratio is {result['median_ratio']}x"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    engine_args = EngineArgs.from_cli(args)
    if engine_args.model is None:
        raise SystemExit("--model DIR is required: the reference engine needs a model directory")
    results = [bench_workload(args, engine_args, w) for w in args.workloads.split(",")]
    report = {
        "workloads": results,
        "pairs": args.pairs,
        "config": engine_kwargs(engine_args),
        "machine": machine_info(),
    }
    if print_report_start(report, args.json):
        return 0
    print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
