"""Microbenchmark of what a TBT SLO adds to the scheduler: schedule() with and without it.

Runs on its own, in one process, with no model. Two schedulers hold the same work every step:
``--running`` decodes (past their prompts, a large max_tokens) and one prompt chunk of
``--chunk`` tokens (a queue of long prompts with max_tokens 1, each chunked by the long-prefill
threshold, so one is always mid-prompt). One has ``tbt_slo_ms`` set so high that the step-cost
model never shrinks a chunk: the difference is the SLO's bookkeeping (the features, the chunk's
closed-form fit, the prediction), not different work. Chunks of steps alternate between the two
(on a shared machine drift then hits both alike); reported are the median of the paired
differences (each chunk with the SLO against the one without it just before) and the best chunk
of each, as in ``python -m benchmarks scheduler``. The refit after each step (``observe``, outside schedule()) is
timed on its own. Usage::

    python -m benchmarks step-budget [--running 256] [--steps 400] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from msgspec.structs import replace

from conveyor.bench.machine import machine_info
from conveyor.engine_core import Request, Scheduler
from conveyor.protocol import CacheConfig, ModelRunnerOutput, SamplingParams, SchedulerConfig

BLOCK_SIZE = 16
DECODE_PROMPT_LEN = 128
LONG_PROMPT_LEN = 4000
MAX_MODEL_LEN = 8192
VOCAB_SIZE = 32000
NUM_CHUNKS = 30
# Far above any predicted step: the model sizes every chunk and never cuts one.
UNBINDING_SLO_MS = 1e6


def build(num_running: int, chunk: int, slo_ms: float | None, steps: int) -> Scheduler:
    """num_running decodes in their steady state and long prompts queued behind them."""
    blocks = num_running * (-(-(DECODE_PROMPT_LEN + 2 * steps + 64) // BLOCK_SIZE) + 1)
    blocks += 4 * (LONG_PROMPT_LEN // BLOCK_SIZE + 2)
    config = SchedulerConfig(
        max_num_batched_tokens=max(2048, num_running + chunk),
        max_num_seqs=num_running + 1,
        max_model_len=MAX_MODEL_LEN,
        long_prefill_token_threshold=chunk,
        tbt_slo_ms=slo_ms,
    )
    scheduler = Scheduler(config, replace(CacheConfig(block_size=BLOCK_SIZE), num_blocks=blocks))
    rng = random.Random(0)
    decode = SamplingParams(max_tokens=MAX_MODEL_LEN, ignore_eos=True, temperature=0.0)
    for req_id in range(num_running):
        prompt = [rng.randrange(VOCAB_SIZE) for _ in range(DECODE_PROMPT_LEN)]
        scheduler.add_request(Request(req_id, prompt, decode, max_model_len=MAX_MODEL_LEN))
    # Past their prompts before the first long prompt arrives (FCFS would admit it first).
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running) or (
        len(scheduler.running) < num_running
    ):
        step(scheduler)
    one_token = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    num_long = -(-(steps + 200) * chunk // LONG_PROMPT_LEN)
    for i in range(num_long):
        prompt = [rng.randrange(VOCAB_SIZE) for _ in range(LONG_PROMPT_LEN)]
        request = Request(num_running + i, prompt, one_token, max_model_len=MAX_MODEL_LEN)
        scheduler.add_request(request)
    return scheduler


def step(scheduler: Scheduler) -> tuple[float, float]:
    """One step; returns (schedule seconds, observe seconds)."""
    t0 = time.perf_counter()
    output = scheduler.schedule()
    t1 = time.perf_counter()
    # A made-up step time near what a CPU takes for this much work: the fit has data.
    scheduled = output.total_num_scheduled_tokens
    t2 = time.perf_counter()
    if scheduler.step_budget is not None and scheduled:
        scheduler.observe_step_time(0.005 + 0.0003 * scheduled)
    t3 = time.perf_counter()
    sampled = [r.req_id for r in output.scheduled_new_reqs] + output.scheduled_cached_reqs.req_ids
    runner_output = ModelRunnerOutput(output.step_id, sampled, [7] * len(sampled))
    scheduler.update_from_output(output, runner_output)
    return t1 - t0, t3 - t2


def measure(num_running: int, chunk: int, steps: int) -> dict[str, object]:
    schedulers = {
        "off": build(num_running, chunk, None, steps),
        "slo": build(num_running, chunk, UNBINDING_SLO_MS, steps),
    }
    for scheduler in schedulers.values():
        for _ in range(20):  # warm caches, the allocator, and the model (past MIN_OBSERVATIONS)
            step(scheduler)
    per_chunk = max(steps // NUM_CHUNKS, 1)
    chunks: dict[str, list[tuple[float, float]]] = {name: [] for name in schedulers}
    for _ in range(NUM_CHUNKS):
        for name, scheduler in schedulers.items():
            schedule_s = observe_s = 0.0
            for _ in range(per_chunk):
                s, o = step(scheduler)
                schedule_s += s
                observe_s += o
            chunks[name].append((schedule_s / per_chunk * 1e6, observe_s / per_chunk * 1e6))
    # Same work: every decode and the same prompt chunks, step for step.
    off, slo = (s.make_stats() for s in schedulers.values())
    assert (off.num_prompt_tokens, off.num_generation_tokens) == (
        slo.num_prompt_tokens,
        slo.num_generation_tokens,
    ), (off, slo)
    off_us = min(c[0] for c in chunks["off"])
    slo_us = min(c[0] for c in chunks["slo"])
    # Each chunk with the SLO against the chunk without it just before: paired differences.
    paired = [b[0] - a[0] for a, b in zip(chunks["off"], chunks["slo"])]
    return {
        "running": num_running,
        "chunk": chunk,
        "schedule_us_without_slo": round(off_us, 1),
        "schedule_us_with_slo": round(slo_us, 1),
        "added_us_best": round(slo_us - off_us, 1),
        "added_us_median_paired": round(statistics.median(paired), 1),
        "observe_us": round(min(c[1] for c in chunks["slo"]), 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks step-budget", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--running", type=int, default=256, help="decodes in every step")
    parser.add_argument("--chunk", type=int, default=64, help="the prompt chunk in every step")
    parser.add_argument("--steps", type=int, default=600, help="measured steps per scheduler")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    rows = [measure(n, args.chunk, args.steps) for n in sorted({64, args.running, 1024})]
    report = {"machine": machine_info(), "rows": rows}
    if args.json:
        print(json.dumps(report))
        return 0
    print("machine:", ", ".join(f"{k}={v}" for k, v in report["machine"].items()))
    header = list(rows[0])
    print("".join(f"{h:>26}" for h in header))
    for row in rows:
        print("".join(f"{row[h]:>26}" for h in header))
    headline = next(r for r in rows if r["running"] == args.running)
    print(
        f"headline: a TBT SLO adds {headline['added_us_median_paired']} us to schedule() at "
        f"{args.running} decodes + one chunk (median of {NUM_CHUNKS} paired chunks; "
        f"{headline['added_us_best']} us best against best), and the refit after the step "
        f"takes {headline['observe_us']} us"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
