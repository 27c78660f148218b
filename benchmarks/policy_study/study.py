"""The scheduling-policy study: static, orca, prefill-first and stall-free on the same model.

    python -m benchmarks policy-study                 # default: about 10 minutes on a 2-core CPU
    python -m benchmarks policy-study --long          # more requests, rates and probes; longer
    python -m benchmarks policy-study --smoke         # the tiny model, seconds (the test's mode)
    python -m benchmarks policy-study --adaptive      # the SLO-aware budget against fixed ones

Runs in its own process; the engines it measures run in child processes. Writes into --out
(default policy_study_out/): report.md (tables, one generated sentence per result, machine,
command, config), results.json (every number), and the PNG plots the report links.

1. Offline throughput on ``conveyor bench offline``'s equal and mix workloads, through
   frontend.LLM.
2. Online: conveyor serve per policy on a free 127.0.0.1 port, driven by the load generator
   (conveyor bench serve, in this process) with sharegpt-like requests at rising rates: median
   TTFT and p99 TBT (ITL) per rate.
3. Serving capacity under a p99 TBT SLO and a median TTFT bound (the load generator's
   --capacity-search with --slo-ttft-median-ms) per policy, and for stall-free per token budget.
   The TTFT bound keeps a policy that only queues (static) from holding the TBT SLO at any rate.

Stall-free gets a small token budget, so long prompts are chunked; the whole-prompt policies
need a budget of at least max_model_len and get exactly that (their smallest legal budget).
The TBT SLO is calibrated first (1.5x a full-budget stall-free step on this machine) unless
--slo-tbt-p99-ms fixes it. Prefix caching is off: the study compares schedulers, and every rate
of the sweep sends the same seeded requests.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks.policy_study.report import STUDY_WORKLOADS, write_report
from benchmarks.policy_study.server import served
from conveyor.bench import offline as bench_offline
from conveyor.bench.loadgen import main as loadgen
from conveyor.bench.machine import Timing, machine_info
from conveyor.frontend.engine_args import EngineArgs
from conveyor.protocol.config import POLICIES
from conveyor.protocol.sampling_params import SamplingParams

STUDY_POLICIES = ("static", "orca", "prefill-first", "stall-free")  # baseline first
WHOLE_PROMPT_POLICIES = ("static", "orca", "prefill-first")


@dataclass(frozen=True)
class StudyConfig:
    """Every knob of one study; the presets below are the reproducible runs."""

    # bench (29M parameters): a 1024-token prefill takes as long as ~30 decode steps on a CPU,
    # so a whole-prompt step visibly stalls generation.
    model_size: str = "bench"
    kv_cache_memory: str = "512M"
    max_model_len: int = 2048
    token_budget: int = 256  # stall-free's; whole-prompt policies get max(this, max_model_len)
    offline_engine: str = "mp"
    offline_num_requests: int = 16
    offline_max_num_seqs: int = 8
    # Small enough that a rate past capacity fills the batch within a capacity probe, so the
    # backlog queues (and shows in TTFT) instead of hiding among the running requests.
    online_max_num_seqs: int = 16
    sharegpt_input_mean: float = 384.0
    sharegpt_output_mean: float = 32.0
    sharegpt_max_len: int = 1024
    online_rates: tuple[float, ...] = (
        2.0,
        4.0,
        6.0,
    )  # the last one past what the CPU keeps up with
    online_num_prompts: int = 16
    # The TBT SLO, fixed; None: calibrated on this machine at the start of the run, as
    # slo_budget_step_factor x the median time of a stall-free step that fills the token
    # budget. Sarathi-Serve also sets its SLOs relative to step times on the hardware: a fixed
    # number of ms means a different experiment on a machine twice as fast. At 1.5x the SLO
    # sits between a stall-free step and a whole prompt of the mean length (1.5x the budget).
    slo_tbt_p99_ms: float | None = None
    slo_budget_step_factor: float = 1.5
    # Sarathi-Serve's capacity also bounds the median scheduling delay, at 2 s: without it a
    # policy that lets requests queue holds the TBT SLO at any rate. The client sees TTFT
    # (scheduling delay plus the prefill), a slightly stricter bound. None: no bound.
    slo_ttft_median_ms: float | None = 2000.0
    # Each probe sends for this long (rate x this many requests): long enough that a backlog
    # past capacity shows in the median TTFT, which a 5 s probe hid.
    capacity_probe_s: float = 8.0
    # ... or longer, to send at least this many: a p99 over a few requests is their maximum,
    # and one long prompt would decide the probe.
    capacity_min_requests: int = 16
    # From 2 req/s (every policy holds 1-2 here) doubling to where a policy breaks, then
    # bisecting: six probes resolve capacity to about 1 req/s, four could only double.
    capacity_max_probes: int = 6
    capacity_start_rate: float = 2.0
    capacity_max_rate: float = 16.0
    capacity_tolerance: float = 0.25
    capacity_budgets: tuple[int, ...] = (128, 256, 512, 2048)
    seed: int = 0


PRESETS: dict[str, StudyConfig] = {
    "default": StudyConfig(),
    "long": StudyConfig(
        kv_cache_memory="1G",
        offline_num_requests=64,
        offline_max_num_seqs=32,
        online_rates=(0.5, 1.0, 2.0, 3.0, 4.0, 5.0),
        online_num_prompts=60,
        capacity_probe_s=20.0,
        capacity_min_requests=40,
        capacity_max_probes=8,
        capacity_start_rate=1.0,
        capacity_tolerance=0.1,
    ),
    "smoke": StudyConfig(
        model_size="tiny",
        kv_cache_memory="64M",
        max_model_len=1024,
        token_budget=64,
        offline_engine="inprocess",
        offline_num_requests=4,
        offline_max_num_seqs=4,
        online_max_num_seqs=8,
        sharegpt_input_mean=64.0,
        sharegpt_output_mean=8.0,
        sharegpt_max_len=256,
        online_rates=(8.0,),
        online_num_prompts=4,
        slo_tbt_p99_ms=50.0,
        capacity_probe_s=0.4,
        capacity_min_requests=2,
        capacity_max_probes=1,
        capacity_start_rate=8.0,
        capacity_budgets=(64,),
    ),
}


def token_budget(config: StudyConfig, policy: str) -> int:
    """Stall-free chunks prompts to its budget; the others must fit the longest prompt whole."""
    if policy in WHOLE_PROMPT_POLICIES:
        return max(config.token_budget, config.max_model_len)
    return config.token_budget


def engine_args(config: StudyConfig, model: str, policy: str, **overrides: Any) -> EngineArgs:
    args = EngineArgs(
        model=model,
        policy=policy,
        max_model_len=config.max_model_len,
        max_num_batched_tokens=token_budget(config, policy),
        kv_cache_memory=_parse_bytes(config.kv_cache_memory),
        # The study is about scheduling: a prefix-cache hit would make a repeated prompt cheap,
        # so every rate of the sweep can send the same requests and differ only in the rate.
        enable_prefix_caching=False,
        seed=config.seed,
    )
    return dataclasses.replace(args, **overrides)


def _parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


# --- 1. offline throughput -----------------------------------------------------------------------


def run_offline(config: StudyConfig, model: str, policies: list[str]) -> list[dict[str, Any]]:
    """Every policy's engine on the same prompts, runs interleaved (equal, then mix), so drift
    on a shared machine hits all policies alike."""
    llms = {}
    try:
        for policy in policies:
            args = engine_args(config, model, policy, max_num_seqs=config.offline_max_num_seqs)
            llms[policy] = bench_offline.start_llm(args, "equal", 2, engine=config.offline_engine)
        rows = []
        for workload in STUDY_WORKLOADS:
            spec = SimpleNamespace(workload=workload, num_requests=config.offline_num_requests)
            for policy, llm in llms.items():
                print(f"offline: {workload}, {policy}", file=sys.stderr, flush=True)
                run = bench_offline.timed_run(llm, spec, progress=False)  # type: ignore[arg-type]
                rows.append({"policy": policy, "workload": workload, **run})
        return rows
    finally:
        for llm in llms.values():
            llm.shutdown()


# --- 2 and 3. online: one server per engine setup (policy_study_server), driven by loadgen -------


def loadgen_argv(config: StudyConfig, url: str, model: str, out: Path) -> list[str]:
    return [
        *("--base-url", url, "--tokenizer", model, "--dataset-name", "sharegpt-like"),
        *("--sharegpt-input-mean", str(config.sharegpt_input_mean)),
        *("--sharegpt-output-mean", str(config.sharegpt_output_mean)),
        *("--sharegpt-max-len", str(config.sharegpt_max_len)),
        *("--seed", str(config.seed), "--no-progress", "--result-json", str(out)),
    ]


def run_loadgen(argv: list[str], out: Path, commands: list[str]) -> dict[str, Any]:
    """One load generator run in this process; its result file is read back."""
    commands.append(shlex.join(["python", "conveyor bench serve", *argv]))
    with contextlib.redirect_stdout(sys.stderr):
        code = loadgen.main(argv)
    if code != 0:
        raise RuntimeError(f"the load generator failed ({code}): {commands[-1]}")
    return json.loads(out.read_text())


def rate_sweep(
    config: StudyConfig, url: str, model: str, policy: str, out: Path, commands: list[str]
) -> list[dict[str, Any]]:
    rows = []
    for rate in config.online_rates:
        path = out / f"online_{policy}_rate{rate:g}.json"
        # The same requests at every rate (no prefix cache), so only the rate differs; each
        # rate warms up alike (the warm-ups come first in the seeded dataset), which also
        # keeps first-request costs out of every table.
        argv = loadgen_argv(config, url, model, path)
        argv += ["--num-prompts", str(config.online_num_prompts), "--request-rate", str(rate)]
        argv += ["--num-warmups", "8"]
        result = run_loadgen(argv, path, commands)
        rows.append({"policy": policy, "request_rate": rate, **_latency_row(result)})
    return rows


def _latency_row(result: dict[str, Any]) -> dict[str, Any]:
    keys = ("completed", "failed", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms")
    keys += ("p99_itl_ms", "output_throughput", "request_throughput")
    return {key: result[key] for key in keys}


def capacity(
    config: StudyConfig,
    url: str,
    model: str,
    slo_ms: float,
    label: str,
    out: Path,
    commands: list[str],
) -> dict[str, Any]:
    path = out / f"capacity_{label}.json"
    argv = loadgen_argv(config, url, model, path)
    # Probes last a fixed time, not a fixed count: a short burst ends before a queue builds up.
    most = max(round(config.capacity_max_rate * config.capacity_probe_s) + 1, 2)
    num_prompts = max(most, config.capacity_min_requests)
    argv += ["--capacity-search", "--slo-tbt-p99-ms", f"{slo_ms:g}"]
    argv += ["--num-prompts", str(num_prompts), "--duration", str(config.capacity_probe_s)]
    argv += ["--capacity-start-rate", str(config.capacity_start_rate)]
    argv += ["--capacity-max-rate", str(config.capacity_max_rate)]
    argv += ["--capacity-max-probes", str(config.capacity_max_probes)]
    argv += ["--capacity-tolerance", str(config.capacity_tolerance)]
    argv += ["--capacity-min-requests", str(config.capacity_min_requests)]
    if config.slo_ttft_median_ms is not None:
        argv += ["--slo-ttft-median-ms", f"{config.slo_ttft_median_ms:g}"]
    result = run_loadgen(argv, path, commands)
    return {
        "capacity": result["capacity_request_rate"],
        "lower_bound": result["capacity_is_lower_bound"],
        "num_probes": len(result["capacity_probes"]),
        "probes": result["capacity_probes"],
    }


def calibrate_slo(config: StudyConfig, model: str, out: Path) -> dict[str, Any]:
    """The TBT SLO for this run: fixed by the config, or measured from stall-free steps that
    fill the token budget (prompts of twice the budget, so every prefill step is full)."""
    if config.slo_tbt_p99_ms is not None:
        return {"slo_tbt_p99_ms": config.slo_tbt_p99_ms, "calibrated": False}
    trace = out / "calibration_trace.jsonl"
    trace.unlink(missing_ok=True)
    args = engine_args(config, model, "stall-free", max_num_seqs=4, trace_steps=str(trace))
    llm = bench_offline.start_llm(args, "equal", 2, engine="inprocess")
    try:
        vocab_size = min(len(llm.get_tokenizer()), llm.config.model.vocab_size)
        rng = random.Random(config.seed)
        for _ in range(3):
            # One prompt at a time: every step is one full prefill chunk, nothing else.
            prompt = [rng.randrange(vocab_size) for _ in range(2 * config.token_budget)]
            llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    full = [
        r["duration_ms"]
        for r in records[-6:]  # the calibration's 3 x 2 steps; the warm-up's come first
        if r["num_prefill_tokens"] + r["num_decode_tokens"] == config.token_budget
    ]
    if len(full) < 3:
        raise RuntimeError(f"calibration saw {len(full)} full-budget steps; see {trace}")
    step_ms = statistics.median(full)
    return {
        "slo_tbt_p99_ms": round(config.slo_budget_step_factor * step_ms, 1),
        "calibrated": True,
        "budget_step_ms": round(step_ms, 1),
        "factor": config.slo_budget_step_factor,
        "token_budget": config.token_budget,
    }


def run_online(
    config: StudyConfig,
    model: str,
    policies: list[str],
    slo: dict[str, Any],
    out: Path,
    commands: list[str],
) -> dict[str, Any]:
    """Per policy one server: the rate sweep, then its capacity; then stall-free per budget."""
    sweep: list[dict[str, Any]] = []
    capacities: list[dict[str, Any]] = []
    slo_ms = slo["slo_tbt_p99_ms"]
    for policy in policies:
        print(f"online: {policy}", file=sys.stderr, flush=True)
        args = engine_args(config, model, policy, max_num_seqs=config.online_max_num_seqs)
        with served(args, out / f"serve_{policy}.log") as url:
            sweep += rate_sweep(config, url, model, policy, out, commands)
            found = capacity(config, url, model, slo_ms, policy, out, commands)
        capacities.append({"policy": policy, "token_budget": args.max_num_batched_tokens, **found})
    budgets = capacity_by_budget(config, model, policies, capacities, slo_ms, out, commands)
    return {
        "slo_tbt_p99_ms": slo_ms,
        "slo_calibration": slo,
        "slo_ttft_median_ms": config.slo_ttft_median_ms,
        "sweep": sweep,
        "capacity": capacities,
        "budgets": budgets,
    }


def capacity_by_budget(
    config: StudyConfig,
    model: str,
    policies: list[str],
    capacities: list[dict[str, Any]],
    slo_ms: float,
    out: Path,
    commands: list[str],
) -> list[dict[str, Any]]:
    """Stall-free's capacity per token budget (the default budget's search is reused)."""
    if "stall-free" not in policies:
        return []
    rows = [
        {**c, "token_budget": config.token_budget}
        for c in capacities
        if c["policy"] == "stall-free"
    ]
    for budget in config.capacity_budgets:
        if budget == config.token_budget:
            continue
        print(f"online: stall-free, token budget {budget}", file=sys.stderr, flush=True)
        args = engine_args(config, model, "stall-free", max_num_seqs=config.online_max_num_seqs)
        args = dataclasses.replace(args, max_num_batched_tokens=budget)
        with served(args, out / f"serve_stall-free_budget{budget}.log") as url:
            found = capacity(
                config, url, model, slo_ms, f"stall-free_budget{budget}", out, commands
            )
        rows.append({"policy": "stall-free", "token_budget": budget, **found})
    return sorted(rows, key=lambda row: row["token_budget"])


def resolve_model(config: StudyConfig, model: str | None) -> str:
    if model is not None:
        return str(Path(model).resolve())
    from benchmarks.fixtures.model_maker import ensure_model

    return str(ensure_model(config.model_size))  # deterministic, cached


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks policy-study",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    preset = parser.add_mutually_exclusive_group()
    preset.add_argument(
        "--long",
        action="store_true",
        help="more rates, requests and probes, longer probes (tens of minutes)",
    )
    preset.add_argument("--smoke", action="store_true", help="tiny model, seconds (tests)")
    parser.add_argument("--out", type=Path, default=Path("policy_study_out"))
    parser.add_argument("--model", default=None, help="model dir (default: generated, cached)")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(STUDY_POLICIES))
    parser.add_argument("--slo-tbt-p99-ms", type=float, default=None)
    parser.add_argument(
        "--slo-ttft-median-ms",
        type=float,
        default=None,
        help=f"capacity's queueing bound (default {StudyConfig.slo_ttft_median_ms:g}; 0: none)",
    )
    parser.add_argument(
        "--report-only", action="store_true", help="rewrite report.md and plots from results.json"
    )
    parser.add_argument(
        "--adaptive",
        action="store_true",
        help="instead: the SLO-aware token budget (--tbt-slo-ms) against fixed budgets on two "
        "models (benchmarks/policy_study/adaptive.py; adaptive.md, adaptive.json)",
    )
    parser.add_argument(
        "--adaptive-models",
        nargs="+",
        default=None,
        metavar="SIZE",
        help="with --adaptive: these model sizes only (default: bench small)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = PRESETS["long" if args.long else "smoke" if args.smoke else "default"]
    if args.slo_tbt_p99_ms is not None:
        config = dataclasses.replace(config, slo_tbt_p99_ms=args.slo_tbt_p99_ms)
    if args.slo_ttft_median_ms is not None:
        ttft_bound = args.slo_ttft_median_ms or None  # 0 turns the bound off
        config = dataclasses.replace(config, slo_ttft_median_ms=ttft_bound)
    policies = sorted(set(args.policies), key=STUDY_POLICIES.index)
    out = args.out.resolve()
    if args.adaptive:
        from benchmarks.policy_study import adaptive

        argv_given = list(sys.argv[1:] if argv is None else argv)
        if args.report_only:
            results = json.loads((out / "adaptive.json").read_text())
            print(f"report: {adaptive.write_adaptive_report(out, results)}")
            return 0
        return adaptive.main(args.smoke, out, args.slo_tbt_p99_ms, argv_given, args.adaptive_models)
    if args.report_only:
        print(f"report: {write_report(out, json.loads((out / 'results.json').read_text()))}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    model = resolve_model(config, args.model)
    commands: list[str] = []
    with Timing() as timing:
        slo = calibrate_slo(config, model, out)
        print(f"TBT SLO: {slo['slo_tbt_p99_ms']:g} ms", file=sys.stderr, flush=True)
        offline = run_offline(config, model, policies)
        online = run_online(config, model, policies, slo, out, commands)
    results = {
        "command": " ".join(
            ["python -m benchmarks policy-study", shlex.join(argv or sys.argv[1:])]
        ),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "seconds": timing.seconds,
        "load_average_at_end": os.getloadavg(),
        "model": model,
        "policies": policies,
        "config": dataclasses.asdict(config),
        "machine": machine_info(matmul_gflops=bench_offline.measure_matmul_gflops()),
        "offline": offline,
        "online": online,
        "loadgen_commands": commands,
    }
    (out / "results.json").write_text(json.dumps(loadgen.jsonable(results), indent=2) + "\n")
    print(f"report: {write_report(out, results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
