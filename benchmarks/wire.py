"""What a decode step costs on the engine -> worker wire: our diff vs resending every request.

Runs on its own, in one process, with no model. The real scheduler runs 256 requests through their
prompts (one fixed "sampled" token per request and step), then every decode step's
``SchedulerOutput`` is framed exactly as the multi-process executor sends it
(``ExecuteModel``, msgpack) and measured. The alternative it is compared with sends the same step
with every request in full (``NewRequestData``: prompt + outputs so far, every block id), as an
engine without worker-side mirrors must. Encode and decode times are msgspec's, best of several
rounds. Usage::

    python -m benchmarks wire [--requests 256] [--prompt-lens 100 1000 10000] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import msgspec
from msgspec.structs import replace

from conveyor.bench.machine import machine_info
from conveyor.engine_core import Request, Scheduler
from conveyor.protocol import (
    CacheConfig,
    ModelRunnerOutput,
    NewRequestData,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
)
from conveyor.protocol.worker_messages import WORKER_COMMAND, ExecuteModel

BLOCK_SIZE = 16
# A Qwen-sized vocabulary: token ids take 3-5 bytes each in msgpack, as in real traffic.
VOCAB_SIZE = 151_936
NUM_DECODE_STEPS = 32
# The engine numbers requests from 0 for its whole life; a long-running one has large ids.
FIRST_REQ_ID = 1_000_000


def build_scheduler(num_requests: int, prompt_len: int) -> Scheduler:
    """A scheduler whose requests all finished their prompts: every step from here is decode."""
    max_model_len = prompt_len + 2 * NUM_DECODE_STEPS + 16
    blocks_per_request = -(-max_model_len // BLOCK_SIZE)
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=num_requests * prompt_len,
            max_num_seqs=num_requests,
            max_model_len=max_model_len,
        ),
        # Random prompts share nothing; hashing 2.5M prompt tokens would only slow the set-up.
        replace(
            CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False),
            num_blocks=num_requests * blocks_per_request + 1,
        ),
    )
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_model_len, ignore_eos=True)
    rng = random.Random(0)
    for i in range(num_requests):
        prompt = [rng.randrange(VOCAB_SIZE) for _ in range(prompt_len)]
        scheduler.add_request(
            Request(FIRST_REQ_ID + i, prompt, params, max_model_len=max_model_len, arrival_time=i)
        )
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running) or (
        len(scheduler.running) < num_requests
    ):
        step(scheduler)
    return scheduler


def step(scheduler: Scheduler) -> SchedulerOutput:
    output = scheduler.schedule()
    sampled = [r.req_id for r in output.scheduled_new_reqs] + output.scheduled_cached_reqs.req_ids
    scheduler.update_from_output(
        output, ModelRunnerOutput(output.step_id, sampled, [7] * len(sampled))
    )
    return output


def resend_everything(scheduler: Scheduler, output: SchedulerOutput) -> SchedulerOutput:
    """The same step with every scheduled request in full, as if workers kept no mirror."""
    cached = output.scheduled_cached_reqs
    requests = {r.req_id: r for r in scheduler.running}
    full = []
    for req_id, num_computed, num_scheduled in zip(
        cached.req_ids, cached.num_computed_tokens, cached.num_scheduled_tokens
    ):
        request = requests[req_id]
        # The history the worker needs: every token up to and including the one to run.
        tokens = request.all_token_ids[: num_computed + num_scheduled]
        block_ids = scheduler.kv_cache_manager.get_block_ids(req_id)
        full.append(
            NewRequestData(
                req_id, tokens, request.sampling_params, block_ids, num_computed, num_scheduled
            )
        )
    return SchedulerOutput(
        output.step_id,
        scheduled_new_reqs=full,
        total_num_scheduled_tokens=output.total_num_scheduled_tokens,
    )


def time_us(function, min_rounds: int = 5, budget_s: float = 0.3) -> float:
    """Best time of one call over repeated rounds, in microseconds."""
    best = float("inf")
    rounds = 0
    start = time.perf_counter()
    while rounds < min_rounds or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - t0)
        rounds += 1
    return best * 1e6


def wire_costs(output: SchedulerOutput) -> dict[str, float]:
    frame = WORKER_COMMAND.encode(ExecuteModel(output))
    return {
        "bytes": len(frame),
        "encode_us": round(time_us(lambda: WORKER_COMMAND.encode(ExecuteModel(output))), 1),
        "decode_us": round(time_us(lambda: WORKER_COMMAND.decode(frame)), 1),
    }


def measure(num_requests: int, prompt_len: int) -> dict[str, object]:
    scheduler = build_scheduler(num_requests, prompt_len)
    # Sizes over many steps: a step where requests cross a block boundary carries new block ids.
    outputs = [step(scheduler) for _ in range(NUM_DECODE_STEPS)]
    assert all(o.scheduled_cached_reqs.num_scheduled_tokens == [1] * num_requests for o in outputs)
    sizes = [len(WORKER_COMMAND.encode(ExecuteModel(o))) for o in outputs]
    # Times on one more step, sent both ways.
    diff_output, full_output = step_and_keep(scheduler)
    diff, full = wire_costs(diff_output), wire_costs(full_output)
    return {
        "prompt_len": prompt_len,
        "diff_bytes_mean": round(statistics.mean(sizes)),
        "diff_bytes_max": max(sizes),
        "diff_encode_us": diff["encode_us"],
        "diff_decode_us": diff["decode_us"],
        "full_bytes": full["bytes"],
        "full_encode_us": full["encode_us"],
        "full_decode_us": full["decode_us"],
        "full_over_diff": round(full["bytes"] / diff["bytes"], 1),
    }


def step_and_keep(scheduler: Scheduler) -> tuple[SchedulerOutput, SchedulerOutput]:
    """One more decode step: (the diff sent, the same step resent in full)."""
    output = scheduler.schedule()
    full = resend_everything(scheduler, output)
    sampled = output.scheduled_cached_reqs.req_ids
    scheduler.update_from_output(
        output, ModelRunnerOutput(output.step_id, sampled, [7] * len(sampled))
    )
    return output, full


def print_table(report: dict) -> None:
    print("machine:", ", ".join(f"{k}={v}" for k, v in report["machine"].items()))
    print("config: ", ", ".join(f"{k}={v}" for k, v in report["config"].items()))
    header = list(report["rows"][0])
    print("".join(f"{h:>16}" for h in header))
    for row in report["rows"]:
        print("".join(f"{row[h]:>16}" for h in header))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks wire", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--requests", type=int, default=256, help="running decode requests")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    report = {
        "machine": machine_info(msgspec=msgspec.__version__),
        "config": {
            "requests": args.requests,
            "block_size": BLOCK_SIZE,
            "vocab_size": VOCAB_SIZE,
            "decode_steps": NUM_DECODE_STEPS,
            "first_req_id": FIRST_REQ_ID,
            "frame": "ExecuteModel(SchedulerOutput), msgpack",
        },
        "rows": [measure(args.requests, n) for n in args.prompt_lens],
    }
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
