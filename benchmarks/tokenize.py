"""Where an HTTP frontend should tokenize: on its event loop, in a thread pool, or in processes.

Runs on its own, with no engine: the frontend's share of a request (tokenizing its prompt) is
isolated from the engine's. ``--concurrency`` coroutines on one event loop (uvloop, as the server
uses) each tokenize prompts, one request after another, the way the server's handlers do; the
three ways are run interleaved, round after round, so their ratios come from one run of one
machine:

- ``loop``: ``tokenizer(text)`` on the event loop itself;
- ``threads``: ``run_in_executor`` on a pool of ``NUM_CPU_THREADS`` threads (what the server
  does: Hugging Face's fast tokenizers release the GIL while they encode);
- ``processes``: ``run_in_executor`` on a pool of ``--processes`` processes that each load the
  tokenizer once (the tokenizer-worker design), paying a pickle of the text and of the ids;
- ``server``: what the HTTP server does, prompts up to ``LOOP_PREPARE_LIMIT`` characters on the
  loop and longer ones in the thread pool.

For each it prints requests per second and the event loop's longest stall (a 1 ms ticker's
worst lateness: what every other stream of the frontend, its /health and its heartbeats would
wait). Usage::

    python -m benchmarks tokenize [--model DIR] [--prompt-tokens 32] [--requests 4000]
        [--large-chars 400000] [--large-requests 24] [--concurrency 64] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from conveyor.bench.machine import machine_info, print_report_start

LONGEST = 1 << 62
# A process's own tokenizer, loaded once by ``_load_in_process``.
_process_tokenizer: Any = None


def _load_in_process(model_dir: str) -> None:
    global _process_tokenizer
    from conveyor.frontend.tokenizer import load_tokenizer

    _process_tokenizer = load_tokenizer(model_dir)
    _process_tokenizer.model_max_length = LONGEST  # no warning for prompts past the context


def _tokenize_in_process(text: str) -> list[int]:
    return list(_process_tokenizer(text).input_ids)


def _make_prompt(tokenizer: Any, num_tokens: int, seed: int) -> str:
    """About ``num_tokens`` tokens of varied code-like text."""
    words = ["def", "return", "value", "index", "(", ")", ":", "+", "x", "self", "items", "for"]
    text, i = "", seed
    while len(tokenizer(text).input_ids) < num_tokens:
        text += words[i % len(words)] + (" " if i % 3 else "\n")
        i = i * 7 + 3
    return text


async def _loop_stall_s(stop: asyncio.Event) -> float:
    """The event loop's worst lateness on a 1 ms sleep until ``stop``."""
    worst = 0.0
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(0.001)
        worst = max(worst, time.perf_counter() - start - 0.001)
    return worst


async def _serve(
    prompts: list[str],
    concurrency: int,
    tokenize: Callable[[str], list[int]],
    executor: Executor | None,
    loop_limit: int,
) -> tuple[float, float]:
    """(requests per second, longest loop stall in seconds) for ``prompts``."""
    loop = asyncio.get_running_loop()
    queue = list(reversed(prompts))

    async def client() -> None:
        while queue:
            text = queue.pop()
            if executor is None or len(text) <= loop_limit:
                tokenize(text)
            else:
                await loop.run_in_executor(executor, tokenize, text)
            await asyncio.sleep(0)  # a handler yields between requests (it awaits the engine)

    stop = asyncio.Event()
    ticker = asyncio.create_task(_loop_stall_s(stop))
    await asyncio.sleep(0.01)
    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    stop.set()
    return len(prompts) / elapsed, await ticker


def run(args: argparse.Namespace) -> dict[str, Any]:
    from conveyor.frontend.engine_args import DEFAULT_MODEL_DIR
    from conveyor.frontend.server.serving import LOOP_PREPARE_LIMIT, NUM_CPU_THREADS
    from conveyor.frontend.tokenizer import load_tokenizer

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    model_dir = str(args.model or DEFAULT_MODEL_DIR)
    tokenizer = load_tokenizer(model_dir)
    tokenizer.model_max_length = LONGEST
    small = [_make_prompt(tokenizer, args.prompt_tokens, i) for i in range(64)]
    workloads = {
        f"small ({args.prompt_tokens} tokens)": [small[i % 64] for i in range(args.requests)],
        f"large ({args.large_chars} chars)": [
            (small[i % 64] * (args.large_chars // len(small[i % 64]) + 1))[: args.large_chars]
            for i in range(args.large_requests)
        ],
    }

    def in_thread(text: str) -> list[int]:
        return list(tokenizer(text).input_ids)

    threads = ThreadPoolExecutor(NUM_CPU_THREADS)
    processes = ProcessPoolExecutor(
        args.processes, get_context("spawn"), initializer=_load_in_process, initargs=(model_dir,)
    )
    ways: dict[str, tuple[Callable[[str], list[int]], Executor | None, int]] = {
        "loop": (in_thread, None, 0),
        "threads": (in_thread, threads, 0),
        "processes": (_tokenize_in_process, processes, 0),
        "server": (in_thread, threads, LOOP_PREPARE_LIMIT),
    }
    # Every process has loaded its tokenizer before anything is timed.
    list(processes.map(_tokenize_in_process, ["warm up"] * args.processes * 4))
    results: dict[str, dict[str, dict[str, float]]] = {}
    try:
        for workload, prompts in workloads.items():
            rates: dict[str, list[float]] = {way: [] for way in ways}
            stalls: dict[str, list[float]] = {way: [] for way in ways}
            for _ in range(args.rounds):
                for way, (tokenize, executor, limit) in ways.items():
                    served = _serve(prompts, args.concurrency, tokenize, executor, limit)
                    rate, stall = asyncio.run(served)
                    rates[way].append(rate)
                    stalls[way].append(stall)
            results[workload] = {
                way: {
                    "requests_per_s": statistics.median(rates[way]),
                    "loop_stall_ms": max(stalls[way]) * 1e3,
                    "vs_threads": statistics.median(rates[way])
                    / statistics.median(rates["threads"]),
                }
                for way in ways
            }
    finally:
        threads.shutdown()
        processes.shutdown()
    return {
        "machine": machine_info(),
        "config": {
            "model": model_dir,
            "concurrency": args.concurrency,
            "threads": NUM_CPU_THREADS,
            "processes": args.processes,
            "loop_prepare_limit_chars": LOOP_PREPARE_LIMIT,
            "rounds": args.rounds,
        },
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks tokenize", description=__doc__)
    parser.add_argument("--model", type=Path, help="model directory (default: the embedded one)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--large-chars", type=int, default=400_000)
    parser.add_argument("--large-requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    report = run(args)
    if print_report_start(report, args.json):
        return 0
    for workload, ways in report["results"].items():
        print(f"\n{workload}")
        print(f"  {'way':<10} {'requests/s':>11} {'vs threads':>11} {'loop stall':>11}")
        for way, row in ways.items():
            print(
                f"  {way:<10} {row['requests_per_s']:>11.0f} {row['vs_threads']:>10.2f}x"
                f" {row['loop_stall_ms']:>9.1f} ms"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
