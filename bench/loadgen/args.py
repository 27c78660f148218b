"""The load generator's command line, and the specs it turns into.

Runs in the load generator's process (conveyor bench serve). Flag names follow ``vllm bench
serve`` where the two overlap (--dataset-name, --random-input-len, --request-rate, --burstiness,
--max-concurrency, --num-prompts, --goodput, --metric-percentiles, --disable-tqdm).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from typing import Any

from conveyor.bench.loadgen.capacity import CapacitySpec
from conveyor.bench.loadgen.datasets import DATASETS, DatasetSpec
from conveyor.bench.loadgen.metrics import parse_goodput
from conveyor.bench.loadgen.runner import TrafficSpec


def build_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="conveyor bench serve",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _server_args(parser.add_argument_group("server"))
    _dataset_args(parser.add_argument_group("dataset"))
    _traffic_args(parser.add_argument_group("traffic"))
    _report_args(parser.add_argument_group("report"))
    _capacity_args(parser.add_argument_group("capacity search and self-test"))
    return parser


def _server_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--base-url", default="http://127.0.0.1:8000")
    group.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    group.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    group.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    group.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into bodies")
    group.add_argument("--temperature", type=float, default=None)
    group.add_argument("--request-timeout-s", type=float, default=600.0)
    group.add_argument(
        "--ready-check-timeout-s",
        type=float,
        default=60.0,
        help="retry one small request until the server answers (0: skip the check)",
    )


def _dataset_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--dataset-name", "--dataset", choices=DATASETS, default="random")
    group.add_argument("--dataset-path", default=None, help="the jsonl dataset's file")
    group.add_argument("--tokenizer", default=None, help="local HF tokenizer dir: exact lengths")
    group.add_argument("--random-input-len", type=int, default=1024)
    group.add_argument("--random-output-len", type=int, default=128)
    group.add_argument("--random-range-ratio", type=float, default=0.0)
    defaults = DatasetSpec()
    group.add_argument("--sharegpt-input-mean", type=float, default=defaults.sharegpt_input_mean)
    group.add_argument("--sharegpt-output-mean", type=float, default=defaults.sharegpt_output_mean)
    group.add_argument("--sharegpt-sigma", type=float, default=defaults.sharegpt_sigma)
    group.add_argument("--sharegpt-min-len", type=int, default=defaults.sharegpt_min_len)
    group.add_argument("--sharegpt-max-len", type=int, default=defaults.sharegpt_max_len)
    group.add_argument("--prefix-len", type=int, default=defaults.prefix_len)
    group.add_argument("--num-prefix-groups", type=int, default=defaults.num_prefix_groups)
    group.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="default: on for the synthetic datasets (exact output lengths), off for jsonl",
    )


def _traffic_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--num-prompts", type=int, default=1000)
    group.add_argument("--request-rate", type=float, default=math.inf, help="req/s; inf: at once")
    group.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1: Poisson")
    group.add_argument("--max-concurrency", type=int, default=None)
    group.add_argument("--duration", type=float, default=None, help="stop sending after S s")
    group.add_argument("--cancel-rate", type=float, default=0.0, help="fraction dropped midway")
    group.add_argument("--num-warmups", type=int, default=0)
    group.add_argument("--seed", type=int, default=0)


def _report_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS")
    group.add_argument("--metric-percentiles", default="90,99")
    group.add_argument("--result-json", default=None, metavar="PATH")
    group.add_argument("--save-detailed", action="store_true", help="per-request arrays too")
    group.add_argument("--label", default=None)
    group.add_argument("--plot", default=None, metavar="OUT.png")
    group.add_argument("--no-progress", "--disable-tqdm", action="store_true")


def _capacity_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--capacity-search", action="store_true")
    group.add_argument("--slo-tbt-p99-ms", type=float, default=None)
    group.add_argument(
        "--slo-ttft-median-ms",
        type=float,
        default=None,
        metavar="MS",
        help="a probe holds only if its median TTFT is within MS too (bounds queueing)",
    )
    defaults = CapacitySpec(slo_itl_p99_ms=0.0)
    group.add_argument("--capacity-start-rate", type=float, default=defaults.start_rate)
    group.add_argument("--capacity-min-rate", type=float, default=defaults.min_rate)
    group.add_argument("--capacity-max-rate", type=float, default=defaults.max_rate)
    group.add_argument("--capacity-max-probes", type=int, default=defaults.max_probes)
    group.add_argument("--capacity-tolerance", type=float, default=defaults.tolerance)
    group.add_argument(
        "--capacity-min-requests",
        type=int,
        default=0,
        metavar="K",
        help="with --duration, a slow probe sends on past the duration until it sent K "
        "requests (a p99 over a handful of requests is their maximum); at most --num-prompts",
    )
    group.add_argument(
        "--self-test",
        action="store_true",
        help="measure this client against a zero-delay fake server (started and stopped here)",
    )


def validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject impossible combinations before anything is sent."""
    try:
        args.goodput_slos = parse_goodput(args.goodput)
        args.percentiles = [float(p) for p in args.metric_percentiles.split(",") if p]
    except ValueError as exc:
        parser.error(str(exc))
    if args.capacity_search and args.slo_tbt_p99_ms is None:
        parser.error("--capacity-search needs --slo-tbt-p99-ms")
    if args.capacity_min_requests < 0:
        parser.error("--capacity-min-requests must be at least 0")
    if args.slo_ttft_median_ms is not None and args.slo_ttft_median_ms <= 0:
        parser.error("--slo-ttft-median-ms must be positive")
    if args.dataset_name == "jsonl" and not args.dataset_path:
        parser.error("--dataset-name jsonl needs --dataset-path")
    if args.num_prompts < 1 or (args.max_concurrency is not None and args.max_concurrency < 1):
        parser.error("--num-prompts and --max-concurrency must be at least 1")
    if not 0.0 <= args.cancel_rate <= 1.0:
        parser.error("--cancel-rate must be in [0, 1]")
    if args.request_rate <= 0 or args.burstiness <= 0:
        parser.error("--request-rate and --burstiness must be positive")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        # Found out before the run, not after it: the results would be lost with the plot.
        parser.error(
            "--plot needs matplotlib, which is not installed: pip install matplotlib (or "
            "conveyor's plot extra, pip install 'conveyor-llm[plot]')"
        )


def dataset_spec(args: argparse.Namespace) -> DatasetSpec:
    return DatasetSpec(
        name=args.dataset_name,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio,
        sharegpt_input_mean=args.sharegpt_input_mean,
        sharegpt_output_mean=args.sharegpt_output_mean,
        sharegpt_sigma=args.sharegpt_sigma,
        sharegpt_min_len=args.sharegpt_min_len,
        sharegpt_max_len=args.sharegpt_max_len,
        prefix_len=args.prefix_len,
        num_prefix_groups=args.num_prefix_groups,
        dataset_path=args.dataset_path,
        ignore_eos=args.ignore_eos,
    )


def traffic_spec(args: argparse.Namespace, request_rate: float | None = None) -> TrafficSpec:
    return TrafficSpec(
        request_rate=args.request_rate if request_rate is None else request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        duration_s=args.duration,
        cancel_rate=args.cancel_rate,
        seed=args.seed,
    )


def capacity_spec(args: argparse.Namespace) -> CapacitySpec:
    return CapacitySpec(
        slo_itl_p99_ms=args.slo_tbt_p99_ms,
        slo_ttft_median_ms=args.slo_ttft_median_ms,
        start_rate=args.capacity_start_rate,
        min_rate=args.capacity_min_rate,
        max_rate=args.capacity_max_rate,
        max_probes=args.capacity_max_probes,
        tolerance=args.capacity_tolerance,
    )


def args_for_json(args: argparse.Namespace) -> dict[str, Any]:
    """The full argument set, JSON-safe (inf as "inf"), the API key redacted."""
    record = {key: jsonable(value) for key, value in vars(args).items()}
    if record.get("api_key"):
        record["api_key"] = "<redacted>"
    return record


def jsonable(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value
