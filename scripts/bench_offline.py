"""Offline throughput: a fixed batch of random-token requests through the engine, timed.

    python scripts/bench_offline.py --model /tmp/bench --workload equal --num-requests 64 \
        --max-num-seqs 64 --max-num-batched-tokens 2048 --json

Workloads (greedy, ignore_eos, so every request produces exactly its output length):
  equal  N requests of 128 prompt tokens and 128 output tokens;
  mix    N requests alternating (32 prompt, 32 output) and (512 prompt, 128 output).
A short warm-up with different prompts runs first, so the timing excludes one-off costs (and the
timed prompts cannot hit the prefix cache). --profile prints where the time went (cProfile).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import platform
import pstats
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from frontend import LLM  # noqa: E402
from frontend.engine_args import EngineArgs, add_engine_args  # noqa: E402
from protocol import SamplingParams  # noqa: E402

WORKLOADS: dict[str, list[tuple[int, int]]] = {
    "equal": [(128, 128)],
    "mix": [(32, 32), (512, 128)],
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


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="equal")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--num-warmup-requests", type=int, default=8)
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--profile", action="store_true", help="cProfile the timed run")
    parser.add_argument(
        "--torch-profile", action="store_true", help="torch.profiler op table of the timed run"
    )
    add_engine_args(parser)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    engine_args = EngineArgs.from_cli(args)
    kwargs = {k: v for k, v in vars(engine_args).items() if k != "model"}
    llm = LLM(engine_args.model, **kwargs)
    vocab_size = min(len(llm.get_tokenizer()), llm.config.model.vocab_size)
    warmup = make_requests(args.workload, args.num_warmup_requests, vocab_size, seed=1)
    llm.generate(*warmup, use_tqdm=False)
    calibration = measure_matmul_gflops()
    prompts, params = make_requests(args.workload, args.num_requests, vocab_size, seed=0)
    profiler = cProfile.Profile() if args.profile else None
    op_profiler = _torch_profiler() if args.torch_profile else contextlib.nullcontext()
    with op_profiler, Timing() as timing:
        if profiler is not None:
            profiler.enable()
        outputs = llm.generate(prompts, params, use_tqdm=not args.json)
        if profiler is not None:
            profiler.disable()
    num_output = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    num_prompt = sum(len(p) for p in prompts)
    result = {
        "workload": args.workload,
        "num_requests": args.num_requests,
        "output_tok_s": round(num_output / timing.seconds, 1),
        "total_tok_s": round((num_output + num_prompt) / timing.seconds, 1),
        **timing.summary(),
        "num_output_tokens": num_output,
        "num_prompt_tokens": num_prompt,
        "model": llm.config.model.model,
        "config": {k: v for k, v in vars(engine_args).items() if k != "model"},
        "machine": _machine(calibration),
    }
    llm.shutdown()
    if profiler is not None:
        _print_profile(profiler)
    if args.torch_profile:
        table = op_profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        print(table, file=sys.stderr)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


class Timing:
    """Wall time of a block, and how much of the machine this process and others used."""

    def __enter__(self) -> Timing:
        self._start = time.perf_counter(), _cpu_seconds(), _system_busy()
        return self

    def __exit__(self, *exc: object) -> None:
        wall, cpu, busy = self._start
        self.seconds = time.perf_counter() - wall
        self.cpu_seconds = _cpu_seconds() - cpu
        self.busy_seconds = _system_busy() - busy

    def summary(self) -> dict[str, float]:
        num_cpus = len(os.sched_getaffinity(0))
        others = max(0.0, self.busy_seconds - self.cpu_seconds)
        return {
            "seconds": round(self.seconds, 3),
            # CPU seconds per wall second per core: well under 1 means this run did not get
            # the cores it asked for.
            "cpu_utilization": round(self.cpu_seconds / self.seconds / num_cpus, 3),
            # Share of the cores busy with OTHER processes meanwhile (Linux): runs on a shared
            # machine are only comparable when this is near 0.
            "other_load": round(others / self.seconds / num_cpus, 3),
        }


def _machine(matmul_gflops: float) -> dict[str, object]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "num_cpus": len(os.sched_getaffinity(0)),
        # fp32 GEMM speed measured just before the run: this machine's speed varies from run to
        # run (shared host), so compare tok/s between runs relative to this.
        "matmul_gflops": matmul_gflops,
        "python": platform.python_version(),
    }


def measure_matmul_gflops(repeats: int = 10) -> float:
    """Best-of-N GFLOP/s of a 2048x512 @ 512x3072 float32 matmul (a prefill MLP shape)."""
    import torch

    a, b = torch.randn(2048, 512), torch.randn(512, 3072)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return round(2 * 2048 * 512 * 3072 / best / 1e9, 1)


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def _system_busy() -> float:
    """CPU seconds all processes spent busy (Linux /proc/stat), 0.0 where unavailable."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


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
