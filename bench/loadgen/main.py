r"""Load generator for any OpenAI-compatible server: latency, throughput, goodput, capacity.

    conveyor bench serve --base-url http://127.0.0.1:8000 --model NAME \
        --dataset-name random --random-input-len 256 --random-output-len 64 \
        --tokenizer /path/to/model --num-prompts 200 --request-rate 4 --burstiness 1 \
        --goodput ttft:500 tpot:50 --result-json out.json --plot out.png

    conveyor bench serve ... --capacity-search --slo-tbt-p99-ms 100 --num-prompts 50 \
        --slo-ttft-median-ms 2000
    conveyor bench serve --self-test      # how fast this client is, against a fake server

Runs in its own process (asyncio, one aiohttp session, streaming always). Each request is timed
chunk by chunk (TTFT, every inter-token gap, E2E latency); the report follows ``vllm bench
serve``'s key names. Ctrl-C stops sending, cancels what is in flight and still prints the report
of what finished; a second Ctrl-C aborts. docs/loadgen.md explains the flags.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import Coroutine
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp

from conveyor.bench.loadgen.args import (
    args_for_json,
    build_parser,
    capacity_spec,
    dataset_spec,
    jsonable,
    traffic_spec,
    validate,
)
from conveyor.bench.loadgen.capacity import SearchStopped, search_capacity
from conveyor.bench.loadgen.client import Endpoint
from conveyor.bench.loadgen.datasets import PromptMaker, SampleRequest, load_tokenizer, make_dataset
from conveyor.bench.loadgen.metrics import detailed, format_summary, summarize
from conveyor.bench.loadgen.ready import first_model, wait_until_ready
from conveyor.bench.loadgen.runner import RunResult, TrafficSpec, open_session, run_requests
from conveyor.bench.machine import machine_info


def run_async(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """uvloop where installed: the client's per-chunk cost is what bounds it."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def _install_stop(stop: asyncio.Event) -> None:
    """First Ctrl-C: stop and report; the handler then goes, so a second one aborts."""
    loop = asyncio.get_running_loop()

    def on_interrupt() -> None:
        print("\ninterrupted: cancelling in-flight requests (Ctrl-C again aborts)", file=sys.stderr)
        stop.set()
        loop.remove_signal_handler(signal.SIGINT)

    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        loop.add_signal_handler(signal.SIGINT, on_interrupt)


async def _warm_up(
    session: aiohttp.ClientSession,
    endpoint: Endpoint,
    samples: list[SampleRequest],
    args: argparse.Namespace,
    stop: asyncio.Event,
) -> None:
    if not samples:
        return
    traffic = TrafficSpec(max_concurrency=args.max_concurrency, seed=args.seed)
    run = await run_requests(session, endpoint, samples, traffic, stop, progress=False)
    num_ok = sum(o.success for o in run.outputs)
    print(f"warm-up: {num_ok}/{len(samples)} requests completed", file=sys.stderr)


async def benchmark(args: argparse.Namespace) -> tuple[dict[str, Any], RunResult | None]:
    """Ready check, warm-ups, then one run or a capacity search: the result dict, and the run
    (None for a capacity search)."""
    stop = asyncio.Event()
    _install_stop(stop)
    extra = dict(args.extra_body)
    if args.temperature is not None:
        extra["temperature"] = args.temperature
    async with open_session(args.max_concurrency, args.request_timeout_s) as session:
        endpoint = Endpoint(args.base_url, args.model or "", args.endpoint, args.api_key, extra)
        if not args.model:
            model = await first_model(session, endpoint, stop, args.ready_check_timeout_s)
            endpoint = replace(endpoint, model=model)
        model = endpoint.model
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
        maker = PromptMaker(tokenizer, endpoint_takes_ids=args.endpoint == "completions")
        spec = dataset_spec(args)
        samples = make_dataset(spec, args.num_warmups + args.num_prompts, args.seed, maker)
        warmups, samples = samples[: args.num_warmups], samples[args.num_warmups :]
        if args.ready_check_timeout_s > 0:
            await wait_until_ready(session, endpoint, stop, args.ready_check_timeout_s)
        await _warm_up(session, endpoint, warmups, args, stop)
        header = _header(args, model)
        if args.capacity_search:
            return {**header, **await _capacity(session, endpoint, maker, args, stop)}, None
        run = await run_requests(
            session, endpoint, samples, traffic_spec(args), stop, not args.no_progress
        )
    result = {**header, **summarize(run, args.goodput_slos, args.percentiles)}
    print(format_summary(result, args.percentiles))
    if args.save_detailed:
        result.update(detailed(run))
    return result, run


async def _capacity(
    session: aiohttp.ClientSession,
    endpoint: Endpoint,
    maker: PromptMaker,
    args: argparse.Namespace,
    stop: asyncio.Event,
) -> dict[str, Any]:
    spec = dataset_spec(args)
    percentiles = sorted({*args.percentiles, 99.0})
    num_probes = 0

    async def probe(rate: float) -> dict[str, Any]:
        nonlocal num_probes
        num_probes += 1
        # A fresh dataset per probe: repeating prompts would let a prefix cache flatter
        # the later probes.
        samples = make_dataset(spec, args.num_prompts, args.seed + num_probes, maker)
        run = await run_requests(
            session, endpoint, samples, probe_traffic(args, rate), stop, not args.no_progress
        )
        if stop.is_set():
            raise SearchStopped
        return summarize(run, args.goodput_slos, percentiles)

    found = await search_capacity(probe, capacity_spec(args))
    if found.interrupted:
        print("capacity search interrupted: the answer is the best rate seen so far")
    if found.capacity is None:
        print("serving capacity: none (no probe held the SLO)")
    else:
        bound = "at least " if found.is_lower_bound else ""
        ttft = args.slo_ttft_median_ms
        ttft_text = "" if ttft is None else f", median TTFT <= {ttft} ms"
        print(
            f"serving capacity: {bound}{found.capacity:.3f} req/s "
            f"(p99 ITL <= {args.slo_tbt_p99_ms} ms{ttft_text}, no failures)"
        )
    return {
        "slo_tbt_p99_ms": args.slo_tbt_p99_ms,
        "slo_ttft_median_ms": args.slo_ttft_median_ms,
        **found.as_dict(),
    }


def probe_traffic(args: argparse.Namespace, rate: float) -> TrafficSpec:
    """A probe's arrivals: --duration, past which the first --capacity-min-requests still go."""
    return replace(traffic_spec(args, rate), min_requests=args.capacity_min_requests)


def _header(args: argparse.Namespace, model: str) -> dict[str, Any]:
    backend = "openai" if args.endpoint == "completions" else "openai-chat"
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": backend,
        "endpoint_type": backend,
        "label": args.label,
        "model_id": model,
        "tokenizer_id": args.tokenizer,
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts,
        "request_rate": jsonable(args.request_rate),
        "burstiness": jsonable(args.burstiness),
        "max_concurrency": args.max_concurrency,
        "cancel_rate": args.cancel_rate,
    }


def _plot_title(args: argparse.Namespace, model: str) -> str:
    # A model is often a long local path: its last part names it.
    return (
        f"{Path(model).name or model}, {args.endpoint}, {args.dataset_name}: rate "
        f"{args.request_rate} req/s, burstiness {args.burstiness}, "
        f"max concurrency {args.max_concurrency}"
    )


def write_result(result: dict[str, Any], args: argparse.Namespace, path: str) -> None:
    record = {**result, "machine": machine_info(), "args": args_for_json(args)}
    Path(path).write_text(json.dumps(jsonable(record), indent=2) + "\n")
    print(f"result: {path}")


def write_plot_after(run: RunResult, args: argparse.Namespace, model: str) -> bool:
    """The --plot PNG, drawn once the results are printed and saved: a plot that fails (an
    unwritable path) costs the plot alone. Whether it was written."""
    from conveyor.bench.loadgen.plot import write_plot

    try:
        path = write_plot(run, args.plot, title=_plot_title(args, model))
    except (ImportError, OSError, ValueError) as exc:
        kept = f" (the results are in {args.result_json})" if args.result_json else ""
        print(f"error: --plot {args.plot}: {exc}{kept}", file=sys.stderr)
        return False
    print(f"plot: {path}")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(__doc__)
    args = parser.parse_args(argv)
    validate(parser, args)
    run = None
    if args.self_test:
        from conveyor.bench.loadgen.selftest import self_test

        result = run_async(self_test(args))
    else:
        try:
            result, run = run_async(benchmark(args))
        except KeyboardInterrupt:
            print("aborted", file=sys.stderr)
            return 130
        except (RuntimeError, aiohttp.ClientError, OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    if args.result_json:
        write_result(result, args, args.result_json)
    if args.plot and run is not None and not write_plot_after(run, args, result["model_id"]):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
