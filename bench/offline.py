"""Offline throughput: a fixed batch of random-token requests through the engine, timed.

    conveyor bench offline --model /tmp/bench --workload equal --num-requests 64 \
        --max-num-seqs 64 --max-num-batched-tokens 2048 --json

    conveyor bench offline --model /tmp/bench --workload mix --compare

--compare-spec times speculative decoding against none on a copying workload
(bench/offline_spec.py).

--compare times the in-process engine, the multi-process engine and the multi-process engine
with async scheduling on the same prompts, interleaved, and prints their ratios (one run, one
machine state). --engine inprocess runs everything in this process.

Workloads (greedy, ignore_eos, so every request produces exactly its output length):
  equal  N requests of 128 prompt tokens and 128 output tokens;
  mix    N requests alternating (32 prompt, 32 output) and (512 prompt, 128 output);
  long   N requests cycling through prompts of 2000, 4000, 3000, 2500, 3500 tokens, 64 outputs;
  uneven N requests of long-tailed prompt and output lengths (log-normal: medians 200 and 60
         tokens, a few requests ten times that), the same lengths on every run: most requests
         finish early and a few long ones decode on in small batches, as served traffic does.
A short warm-up with different prompts runs first, so the timing excludes one-off costs (and the
timed prompts cannot hit the prefix cache). --profile prints where the time went (cProfile).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import sys
import time

import numpy as np

from conveyor.bench.machine import Timing, machine_info
from conveyor.bench.phase_times import PhaseTimes, format_report
from conveyor.frontend import LLM
from conveyor.frontend.engine_args import EngineArgs, add_engine_args
from conveyor.protocol import SamplingParams


def long_tailed_shapes(count: int, seed: int = 20261126) -> list[tuple[int, int]]:
    """(prompt, output) lengths, log-normal (sigma 1): medians 200 and 60 tokens, clipped to
    16-3,000 and 4-800, so that prompt and output fit a 4,096-token context. Seeded: every run
    and both engines of `bench reference` get the same lengths."""
    rng = np.random.default_rng(seed)
    prompts = np.clip(np.rint(rng.lognormal(np.log(200), 1.0, count)), 16, 3000)
    outputs = np.clip(np.rint(rng.lognormal(np.log(60), 1.0, count)), 4, 800)
    return [(int(p), int(o)) for p, o in zip(prompts, outputs, strict=True)]


WORKLOADS: dict[str, list[tuple[int, int]]] = {
    "equal": [(128, 128)],
    "mix": [(32, 32), (512, 128)],
    # Prompt-heavy: prefill dominates (use --num-requests 16).
    "long": [(2000, 64), (4000, 64), (3000, 64), (2500, 64), (3500, 64)],
    # Requests take these in order (the warm-up the first few, with other tokens).
    "uneven": long_tailed_shapes(256),
}


def make_requests(
    workload: str, num_requests: int, vocab_size: int, seed: int
) -> tuple[list[list[int]], list[SamplingParams]]:
    """Random prompts (seeded) and greedy params that force each request's output length."""
    rng = np.random.default_rng(seed)
    shapes = WORKLOADS[workload]
    prompts, params = [], []
    for i in range(num_requests):
        prompt_len, output_len = shapes[i % len(shapes)]
        prompts.append(rng.integers(0, vocab_size, prompt_len).tolist())
        params.append(SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
    return prompts, params


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="conveyor bench offline", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="equal")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--num-warmup-requests", type=int, default=8)
    parser.add_argument(
        "--engine",
        choices=("mp", "inprocess"),
        default="mp",
        help="mp: engine core and workers in their own processes (default); inprocess: one process",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="time in-process, multi-process sync and multi-process async scheduling in one run "
        "(interleaved --repeats times) and report ratios to in-process",
    )
    parser.add_argument(
        "--compare-spec",
        action="store_true",
        help="speculative decoding on a copying workload (a source file, then its first lines "
        "again): output tok/s without and with --speculative-config (default ngram, k=5 over "
        "4-grams) and the acceptance rate at each --batch-sizes, interleaved --repeats times",
    )
    parser.add_argument("--batch-sizes", default="1,4,16,64", help="for --compare-spec")
    parser.add_argument(
        "--spec-workload",
        choices=("copy", "random"),
        default="copy",
        help="--compare-spec's prompts: copy (a source file, then its first lines again) or "
        "random (random tokens: drafts rarely right, what speculation costs)",
    )
    parser.add_argument(
        "--spec-max-tokens", type=int, default=128, help="output tokens (--compare-spec)"
    )
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per setup (--compare)")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--profile", action="store_true", help="cProfile the timed run")
    parser.add_argument(
        "--torch-profile", action="store_true", help="torch.profiler op table of the timed run"
    )
    parser.add_argument(
        "--phase-times",
        action="store_true",
        help="time the timed run's phases (scheduling, input preparation, linears, attention, "
        "sampling, ...); needs --engine inprocess",
    )
    add_engine_args(parser)
    args = parser.parse_args(argv)
    if args.phase_times and (args.engine != "inprocess" or args.compare):
        parser.error("--phase-times needs --engine inprocess (one process sees every phase)")
    return args


def engine_kwargs(engine_args: EngineArgs, **overrides: object) -> dict[str, object]:
    kwargs = {k: v for k, v in vars(engine_args).items() if k != "model"}
    kwargs.update(overrides)
    return kwargs


def start_llm(engine_args: EngineArgs, workload: str, num_warmup: int, **overrides) -> LLM:
    """An engine, warmed up on prompts the timed run will not hit in the prefix cache."""
    llm = LLM(engine_args.model, **engine_kwargs(engine_args, **overrides))
    vocab_size = min(len(llm.get_tokenizer()), llm.config.model.vocab_size)
    llm.generate(*make_requests(workload, num_warmup, vocab_size, seed=1), use_tqdm=False)
    return llm


def timed_requests(
    llm: LLM, workload: str, num_requests: int, repeat: int
) -> tuple[list[list[int]], list[SamplingParams]]:
    """The prompts of timed run `repeat` (also what bench reference gives the other engine)."""
    vocab_size = min(len(llm.get_tokenizer()), llm.config.model.vocab_size)
    seed = 0 if repeat == 0 else 100 + repeat
    return make_requests(workload, num_requests, vocab_size, seed=seed)


def timed_run(
    llm: LLM, args: argparse.Namespace, progress: bool, repeat: int = 0
) -> dict[str, object]:
    """One timed batch; each repeat gets new prompts, so none hits the prefix cache."""
    prompts, params = timed_requests(llm, args.workload, args.num_requests, repeat)
    with Timing() as timing:
        outputs = llm.generate(prompts, params, use_tqdm=progress)
    num_output = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    num_prompt = sum(len(p) for p in prompts)
    return {
        "output_tok_s": round(num_output / timing.seconds, 1),
        "total_tok_s": round((num_output + num_prompt) / timing.seconds, 1),
        **timing.summary(),
        "num_output_tokens": num_output,
        "num_prompt_tokens": num_prompt,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    engine_args = EngineArgs.from_cli(args)
    if args.compare:
        return compare(args, engine_args)
    if args.compare_spec:
        from conveyor.bench.offline_spec import compare_spec

        return compare_spec(args, engine_kwargs(engine_args))
    llm = start_llm(engine_args, args.workload, args.num_warmup_requests, engine=args.engine)
    calibration = measure_matmul_gflops()
    profiler = cProfile.Profile() if args.profile else None
    op_profiler = _torch_profiler() if args.torch_profile else contextlib.nullcontext()
    phases = PhaseTimes() if args.phase_times else None
    with op_profiler, phases.timing() if phases else contextlib.nullcontext():
        if profiler is not None:
            profiler.enable()
        run = timed_run(llm, args, progress=not args.json)
        if profiler is not None:
            profiler.disable()
    if phases is not None:
        run["phases"] = phases.report(float(run["seconds"]))
        print(format_report(run["phases"]), file=sys.stderr)
    result = {
        "workload": args.workload,
        "num_requests": args.num_requests,
        "engine": args.engine,
        **run,
        "model": llm.config.model.model,
        "config": engine_kwargs(engine_args),
        "machine": machine_info(matmul_gflops=calibration),
    }
    llm.shutdown()
    if profiler is not None:
        _print_profile(profiler)
    if args.torch_profile:
        table = op_profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        print(table, file=sys.stderr)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


# name -> LLM overrides; the first is the baseline the others are divided by.
SETUPS: dict[str, dict[str, object]] = {
    "inprocess": {"engine": "inprocess", "async_scheduling": False},
    "mp_sync": {"engine": "mp", "async_scheduling": False},
    "mp_async": {"engine": "mp", "async_scheduling": True},
}


def compare(args: argparse.Namespace, engine_args: EngineArgs) -> int:
    """Every setup on the same prompts, runs interleaved so drift on a shared host hits all."""
    llms = {
        name: start_llm(engine_args, args.workload, args.num_warmup_requests, **overrides)
        for name, overrides in SETUPS.items()
    }
    calibration = measure_matmul_gflops()
    runs: dict[str, list[dict[str, object]]] = {name: [] for name in SETUPS}
    try:
        for repeat in range(args.repeats):
            for name, llm in llms.items():
                runs[name].append(timed_run(llm, args, progress=False, repeat=repeat))
    finally:
        for llm in llms.values():
            llm.shutdown()
    best = {name: max(float(r["output_tok_s"]) for r in rs) for name, rs in runs.items()}
    baseline = best[next(iter(SETUPS))]
    result = {
        "workload": args.workload,
        "num_requests": args.num_requests,
        "best_output_tok_s": best,
        "ratio_to_inprocess": {name: round(v / baseline, 3) for name, v in best.items()},
        "runs": runs,
        "config": engine_kwargs(engine_args),
        "machine": machine_info(matmul_gflops=calibration),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print("machine:", ", ".join(f"{k}={v}" for k, v in result["machine"].items()))
    print(f"workload: {args.workload}, {args.num_requests} requests, best of {args.repeats}")
    print(f"{'setup':>10} {'output tok/s':>13} {'ratio':>7}  runs (output tok/s, other_load)")
    for name, rs in runs.items():
        per_run = ", ".join(f"{r['output_tok_s']} ({r['other_load']})" for r in rs)
        ratio = result["ratio_to_inprocess"][name]
        print(f"{name:>10} {best[name]:>13} {ratio:>7}  {per_run}")
    return 0


def measure_matmul_gflops(repeats: int = 10) -> float:
    """Best-of-N GFLOP/s of a 2048x512 @ 512x3072 float32 matmul (a prefill MLP shape), by the
    faster of torch's two CPU paths: MKL's sgemm (``a @ b``) and oneDNN with the weight packed
    (what the engine's linears use where it is faster: worker/layers/gemm.py). On a Zen 4 the
    packed path is ~15 % faster, and a roofline against sgemm alone would flatter the engine."""
    import torch

    from conveyor.worker.layers.gemm import pack_weight

    a, b = torch.randn(2048, 512), torch.randn(512, 3072)
    paths = [lambda: a @ b]
    if (packed := pack_weight(b.t().contiguous())) is not None:
        paths.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
    best = float("inf")
    for path in paths:
        path()
        for _ in range(repeats):
            start = time.perf_counter()
            path()
            best = min(best, time.perf_counter() - start)
    return round(2 * 2048 * 512 * 3072 / best / 1e9, 1)


def _torch_profiler():
    import torch

    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])


def _print_profile(profiler: cProfile.Profile) -> None:
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    print(stream.getvalue(), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
