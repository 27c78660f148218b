"""The scheduling-policy study: static, orca, prefill-first and stall-free on the same model.

    python scripts/policy_study.py                 # default: a few minutes on a 2-core CPU
    python scripts/policy_study.py --long          # more requests, more rates, the bench model
    python scripts/policy_study.py --smoke         # the tiny model, seconds (the test's mode)

Runs in its own process; the engines it measures run in child processes. Writes into --out
(default policy_study_out/): report.md (tables, one generated sentence per result, machine,
command, config), results.json (every number), and the PNG plots the report links.

1. Offline throughput on bench_offline.py's equal and mix workloads, through frontend.LLM.
2. Online: scripts/serve.py per policy on a free 127.0.0.1 port, driven by the load generator
   (scripts/loadgen.py, in this process) with sharegpt-like requests at rising rates: median
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
import queue
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS.parent))
sys.path.insert(0, str(SCRIPTS))

import bench_offline  # noqa: E402
import loadgen  # noqa: E402
from bench_common import Timing, machine_info  # noqa: E402

from engine_core.process_utils import descendants, proc_stat_fields  # noqa: E402
from frontend.engine_args import EngineArgs  # noqa: E402
from protocol.config import POLICIES  # noqa: E402
from protocol.sampling_params import SamplingParams  # noqa: E402

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


# --- 1. offline throughput -------------------------------------------------------------------


def run_offline(config: StudyConfig, model: str, policies: list[str]) -> list[dict[str, Any]]:
    """Every policy's engine on the same prompts, runs interleaved (equal, then mix), so drift
    on a shared machine hits all policies alike."""
    llms = {}
    try:
        for policy in policies:
            args = engine_args(config, model, policy, max_num_seqs=config.offline_max_num_seqs)
            llms[policy] = bench_offline.start_llm(args, "equal", 2, engine=config.offline_engine)
        rows = []
        for workload in bench_offline.WORKLOADS:
            spec = SimpleNamespace(workload=workload, num_requests=config.offline_num_requests)
            for policy, llm in llms.items():
                print(f"offline: {workload}, {policy}", file=sys.stderr, flush=True)
                run = bench_offline.timed_run(llm, spec, progress=False)  # type: ignore[arg-type]
                rows.append({"policy": policy, "workload": workload, **run})
        return rows
    finally:
        for llm in llms.values():
            llm.shutdown()


# --- 2 and 3. online: one server per engine setup, driven by the load generator -------------


def free_port() -> int:
    """A port free now, outside the ephemeral range (no outgoing connection takes it first)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    for port in random.sample([p for p in range(20000, 30000) if not low <= p <= high], 50):
        with socket.socket() as sock, contextlib.suppress(OSError):
            sock.bind(("127.0.0.1", port))
            return port
    raise RuntimeError("no free port found")


def _process_tree(root: int) -> dict[int, str]:
    """pid -> start time of every live descendant of ``root`` (the start time tells a pid
    that was reused apart from ours)."""
    tree = {}
    for pid in descendants(root):
        if (fields := proc_stat_fields(pid)) is not None:
            tree[pid] = fields[19]
    return tree


def _kill_leftovers(tree: dict[int, str]) -> None:
    for pid, start in tree.items():
        fields = proc_stat_fields(pid)
        if fields is not None and fields[19] == start and fields[0] not in "ZX":
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def served(args: EngineArgs, log: Path, timeout_s: float = 180.0) -> Iterator[str]:
    """scripts/serve.py on a free 127.0.0.1 port; yields its base URL; always stops it all."""
    command = [sys.executable, str(SCRIPTS / "serve.py"), "--host", "127.0.0.1"]
    command += ["--port", str(free_port()), *engine_flags(args)]
    with log.open("w") as log_file:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=log_file, text=True, start_new_session=True
        )
    tree: dict[int, str] = {}
    try:
        url = _wait_ready(process, timeout_s)
        tree = _process_tree(process.pid)
        if url is None:
            raise RuntimeError(f"serve.py did not become ready; see {log}")
        yield url
    finally:
        tree.update(_process_tree(process.pid))
        _stop(process)
        _kill_leftovers(tree)


def engine_flags(args: EngineArgs) -> list[str]:
    return [
        *("--model", str(args.model), "--policy", args.policy),
        *("--max-model-len", str(args.max_model_len)),
        *("--max-num-batched-tokens", str(args.max_num_batched_tokens)),
        *("--max-num-seqs", str(args.max_num_seqs)),
        *("--kv-cache-memory", str(args.kv_cache_memory), "--seed", str(args.seed)),
        "--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching",
    ]


def _wait_ready(process: subprocess.Popen[str], timeout_s: float) -> str | None:
    lines: queue.Queue[str] = queue.Queue()
    assert process.stdout is not None
    stdout = process.stdout
    threading.Thread(target=lambda: [lines.put(x) for x in stdout], daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.2).strip()
        except queue.Empty:
            if process.poll() is not None:
                return None
            continue
        if line.startswith("ready: http://"):
            return line.split(" ", 1)[1]
    return None


def _stop(process: subprocess.Popen[str]) -> None:
    """SIGTERM (frontends drain, then the engine stops), SIGKILL the group if it hangs."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30.0)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(10.0)


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
    commands.append(shlex.join(["python", "scripts/loadgen.py", *argv]))
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


# --- the report --------------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += [
        "| " + " | ".join(fmt(v) if not isinstance(v, str) else v for v in row) + " |"
        for row in rows
    ]
    return "\n".join(lines)


def offline_section(rows: list[dict[str, Any]], policies: list[str]) -> list[str]:
    by = {(r["policy"], r["workload"]): r for r in rows}
    base = "static" if "static" in policies else policies[0]
    workloads = list(bench_offline.WORKLOADS)
    header = ["policy", *(f"{w} output tok/s" for w in workloads)]
    header += [f"{w} vs {base}" for w in workloads] + ["other load (max)"]
    body = []
    for policy in policies:
        tok_s = [by[(policy, w)]["output_tok_s"] for w in workloads]
        vs = [ratio(t, by[(base, w)]["output_tok_s"]) for t, w in zip(tok_s, workloads)]
        load = max(by[(policy, w)]["other_load"] for w in workloads)
        body.append([policy, *tok_s, *(f"{v:.2f}x" for v in vs), f"{load:.2f}"])
    sentences = []
    for w in workloads:
        base_tok_s = by[(base, w)]["output_tok_s"]
        others = [p for p in policies if p != base] or [base]
        top = max(others, key=lambda p: by[(p, w)]["output_tok_s"])
        gain = ratio(by[(top, w)]["output_tok_s"], base_tok_s) or 0.0
        verb = "beats" if gain >= 1.0 else "trails"
        sentences.append(
            f"On `{w}`, the best of the others, {top}, {verb} {base} with "
            f"{by[(top, w)]['output_tok_s']:.0f} vs {base_tok_s:.0f} output tok/s ({gain:.2f}x)."
        )
    return [table(header, body), "", *("- " + s for s in sentences)]


def online_section(online: dict[str, Any], policies: list[str]) -> list[str]:
    header = ["policy", "rate (req/s)", "completed", "failed", "median TTFT (ms)"]
    header += ["p99 TTFT (ms)", "median TBT (ms)", "p99 TBT (ms)", "output tok/s"]
    keys = ("completed", "failed", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms")
    keys += ("p99_itl_ms", "output_throughput")
    body = [[r["policy"], r["request_rate"], *(r[k] for k in keys)] for r in online["sweep"]]
    return [table(header, body), "", *("- " + s for s in online_sentences(online["sweep"]))]


def online_sentences(sweep: list[dict[str, Any]]) -> list[str]:
    top = max(r["request_rate"] for r in sweep)
    at_top = {r["policy"]: r for r in sweep if r["request_rate"] == top}
    fast = min(at_top, key=lambda p: at_top[p]["median_ttft_ms"])
    slow = max(at_top, key=lambda p: at_top[p]["median_ttft_ms"])
    sentences = [
        f"At the highest rate ({top:g} req/s) median TTFT is lowest with {fast} "
        f"({at_top[fast]['median_ttft_ms']:.0f} ms) and highest with {slow} "
        f"({at_top[slow]['median_ttft_ms']:.0f} ms)."
    ]
    if "stall-free" in at_top and "prefill-first" in at_top:
        sf, pf = at_top["stall-free"]["p99_itl_ms"], at_top["prefill-first"]["p99_itl_ms"]
        if max(sf, pf) < 1.1 * min(sf, pf):
            comparison = "about the same as"
        else:
            comparison = f"{pf / sf:.1f}x lower than" if sf < pf else f"{sf / pf:.1f}x higher than"
        spread = {
            p: [r["p99_itl_ms"] for r in sweep if r["policy"] == p]
            for p in ("stall-free", "prefill-first")
        }
        sentences.append(
            f"Stall-free's p99 TBT at {top:g} req/s is {comparison} prefill-first's "
            f"({sf:.0f} vs {pf:.0f} ms); over the rates it spans {min(spread['stall-free']):.0f}"
            f"-{max(spread['stall-free']):.0f} ms, prefill-first's "
            f"{min(spread['prefill-first']):.0f}-{max(spread['prefill-first']):.0f} ms."
        )
    return sentences


def capacity_text(row: dict[str, Any]) -> str:
    if row["capacity"] is None:
        return "none held"
    return ("≥ " if row["lower_bound"] else "") + f"{row['capacity']:.2f}"


def capacity_section(online: dict[str, Any]) -> list[str]:
    header = [
        "policy",
        "token budget",
        "capacity (req/s)",
        "mean E2E at capacity (s)",
        "probes",
        "p99 TBT / median TTFT per probe (ms @ req/s)",
    ]
    lines = [f"SLO: {slo_text(online)}, no failed request.", ""]
    body = [_capacity_row(r, r["policy"]) for r in online["capacity"]]
    lines += [table(header, body), ""]
    lines.append("- " + capacity_sentence(online["capacity"]))
    if sentence := queueing_sentence(online["capacity"], online.get("slo_ttft_median_ms")):
        lines.append("- " + sentence)
    if online["budgets"]:
        lines += ["", "Stall-free by token budget (`--max-num-batched-tokens`):", ""]
        body = [_capacity_row(r, "stall-free") for r in online["budgets"]]
        lines += [table(header, body), ""]
        lines.append("- " + budget_sentence(online["budgets"]))
    return lines


def slo_bounds(online: dict[str, Any]) -> str:
    # .get: results.json files written before the TTFT bound existed have no such key.
    ttft = online.get("slo_ttft_median_ms")
    bound = "" if ttft is None else f", median TTFT ≤ {ttft:g} ms"
    return f"p99 TBT ≤ {online['slo_tbt_p99_ms']:g} ms{bound}"


def slo_text(online: dict[str, Any]) -> str:
    text = slo_bounds(online)
    calibration = online.get("slo_calibration") or {}
    if calibration.get("calibrated"):
        text += (
            f" (the TBT bound is {calibration['factor']:g}x the {calibration['budget_step_ms']:g}"
            f" ms a full {calibration['token_budget']}-token stall-free step took here)"
        )
    return text


def capacity_sentence(rows: list[dict[str, Any]]) -> str:
    held = [r for r in rows if r["capacity"] is not None]
    if not held:
        return "No policy held the SLO at any probed rate: raise the SLO or lower the rates."
    top = max(held, key=lambda r: r["capacity"])
    best = [r["policy"] for r in held if r["capacity"] == top["capacity"]]
    lead = f"{best[0]} sustains" if len(best) == 1 else f"{' and '.join(best)} tie for"
    rest = ", ".join(f"{r['policy']} {capacity_text(r)}" for r in rows if r["policy"] not in best)
    text = f"{lead} the most load under the SLO: {capacity_text(top)} req/s"
    if rest:
        ratios = [
            f"{top['capacity'] / r['capacity']:.1f}x {r['policy']}'s"
            for r in rows
            if r["policy"] not in best and r["capacity"]
        ]
        text += f" ({', '.join(ratios)})" if ratios else ""
        text += f"; {rest}"
    return text + "."


def _capacity_row(row: dict[str, Any], name: str) -> list[Any]:
    probes = ", ".join(
        f"{p['p99_itl_ms']:.0f} / {_ms_text(p.get('median_ttft_ms'))} @ {p['request_rate']:.2f}"
        for p in row["probes"]
    )
    e2el = _e2el_at_capacity(row)
    e2el_text = "n/a" if e2el is None else f"{e2el / 1000:.1f}"
    return [name, row["token_budget"], capacity_text(row), e2el_text, row["num_probes"], probes]


def _ms_text(value: float | None) -> str:
    # Probes recorded before the TTFT bound existed have no median TTFT.
    return "n/a" if value is None else f"{value:.0f}"


def _e2el_at_capacity(row: dict[str, Any]) -> float | None:
    """Mean end-to-end latency (ms) of the probe at the capacity rate."""
    return next(
        (p["mean_e2el_ms"] for p in row["probes"] if p["request_rate"] == row["capacity"]), None
    )


def queueing_sentence(rows: list[dict[str, Any]], ttft_bound_ms: float | None) -> str | None:
    """How long requests took at each policy's capacity: without the median TTFT bound the TBT
    SLO does not bound queueing, so this says which policy held it only by making requests
    wait; with it, how far apart the policies still are within the bound."""
    measured = [(r, _e2el_at_capacity(r)) for r in rows if _e2el_at_capacity(r) is not None]
    if len(measured) < 2:
        return None
    worst, worst_ms = max(measured, key=lambda m: m[1])
    best, best_ms = min(measured, key=lambda m: m[1])
    if ttft_bound_ms is None:
        lead = "The TBT SLO does not bound queueing"
    else:
        lead = f"With queueing bounded (median TTFT ≤ {ttft_bound_ms:g} ms)"
    return (
        f"{lead}: at its capacity rate {worst['policy']}'s mean "
        f"end-to-end latency is {worst_ms / 1000:.1f} s against {best_ms / 1000:.1f} s for "
        f"{best['policy']} at its own capacity rate."
    )


def budget_sentence(rows: list[dict[str, Any]]) -> str:
    held = [r for r in rows if r["capacity"] is not None]
    if not held:
        return "No token budget held the SLO at any probed rate."
    best = max(held, key=lambda r: r["capacity"])
    worst = min(rows, key=lambda r: r["capacity"] or 0.0)
    return (
        f"The budget of {best['token_budget']} tokens gives the highest capacity "
        f"({capacity_text(best)} req/s), {worst['token_budget']} the lowest "
        f"({capacity_text(worst)}): small budgets cut each step's time (and TBT) but spend more "
        "steps per prompt, large ones the reverse."
    )


# --- plots -------------------------------------------------------------------------------------


def plot_offline(rows: list[dict[str, Any]], policies: list[str], path: Path) -> None:
    import matplotlib.pyplot as plt

    workloads = list(bench_offline.WORKLOADS)
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(policies)
    for i, policy in enumerate(policies):
        values = [
            next(r["output_tok_s"] for r in rows if r["policy"] == policy and r["workload"] == w)
            for w in workloads
        ]
        ax.bar([x + i * width for x in range(len(workloads))], values, width, label=policy)
    ax.set_xticks([x + width * (len(policies) - 1) / 2 for x in range(len(workloads))], workloads)
    ax.set_ylabel("output tokens/s")
    ax.set_title("offline throughput")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_online(sweep: list[dict[str, Any]], policies: list[str], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key, ax, title in (
        ("median_ttft_ms", axes[0], "median TTFT"),
        ("p99_itl_ms", axes[1], "p99 TBT (inter-token latency)"),
    ):
        for policy in policies:
            rows = [r for r in sweep if r["policy"] == policy]
            ax.plot([r["request_rate"] for r in rows], [r[key] for r in rows], "o-", label=policy)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_capacity(online: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, rows, name, title in (
        (axes[0], online["capacity"], "policy", "capacity per policy"),
        (axes[1], online["budgets"], "token_budget", "stall-free capacity per token budget"),
    ):
        labels = [str(r[name]) for r in rows]
        ax.bar(labels, [r["capacity"] or 0.0 for r in rows])
        ax.set_ylabel("req/s under the SLO")
        ax.set_title(title)
    fig.suptitle(f"SLO: {slo_bounds(online)}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- the study ---------------------------------------------------------------------------------


def write_report(out: Path, results: dict[str, Any]) -> Path:
    policies = results["policies"]
    online = results["online"]
    plot_offline(results["offline"], policies, out / "offline_throughput.png")
    plot_online(online["sweep"], policies, out / "online_latency.png")
    plot_capacity(online, out / "capacity.png")
    config = results["config"]
    lines = [
        "# Scheduling policy study",
        "",
        f"Command: `{results['command']}` ({results['seconds'] / 60:.1f} min, {results['date']}).",
        "",
        f"Model: `{results['model']}`; stall-free token budget {config['token_budget']}, the "
        f"whole-prompt policies {max(config['token_budget'], config['max_model_len'])} "
        f"(max_model_len {config['max_model_len']}).",
        "",
        "Every process here shares the same cores (engine, workers, frontend and the load "
        "generator), and the machine may be shared with other jobs (the offline table shows "
        "their share of the cores per run; 1/5/15-min load average at the end: "
        f"{', '.join(f'{v:.1f}' for v in results['load_average_at_end'])}), so the numbers are "
        "noisy: compare ratios measured in one run, not absolute values across runs.",
        "",
        "## 1. Offline throughput",
        "",
        f"{config['offline_num_requests']} requests per workload (bench_offline.py's `equal`: "
        "128 in / 128 out; `mix`: alternating 32/32 and 512/128), max_num_seqs "
        f"{config['offline_max_num_seqs']}, greedy, ignore_eos.",
        "",
        *offline_section(results["offline"], policies),
        "",
        "![offline throughput](offline_throughput.png)",
        "",
        "## 2. Online latency at rising request rates",
        "",
        f"sharegpt-like requests (lognormal lengths: input mean {config['sharegpt_input_mean']:g}, "
        f"output mean {config['sharegpt_output_mean']:g}, at most {config['sharegpt_max_len']}), "
        f"{config['online_num_prompts']} per rate, Poisson arrivals, max_num_seqs "
        f"{config['online_max_num_seqs']}.",
        "",
        *online_section(online, policies),
        "",
        "![online latency](online_latency.png)",
        "",
        "## 3. Serving capacity under latency SLOs",
        "",
        "Bracketing, then bisection over request rates (loadgen `--capacity-search`); each probe "
        f"sends for {config['capacity_probe_s']:g} s (rate x that many requests; at least "
        f"{config.get('capacity_min_requests', 0)}, past the {config['capacity_probe_s']:g} s "
        "at low rates), at most "
        f"{config['capacity_max_probes']} probes per search, rates up to "
        f"{config['capacity_max_rate']:g} req/s.",
        "",
        *capacity_section(online),
        "",
        "![capacity](capacity.png)",
        "",
        "## Machine and config",
        "",
        "```json",
        json.dumps({"machine": results["machine"], "config": config}, indent=2),
        "```",
        "",
        "The load generator commands (each run in-process, equivalent to these) are in "
        "results.json under `loadgen_commands`.",
    ]
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    return report


def resolve_model(config: StudyConfig, model: str | None) -> str:
    if model is not None:
        return str(Path(model).resolve())
    from worker.model_maker import ensure_default_model

    return str(ensure_default_model(config.model_size))  # deterministic, cached


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
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
        "command": shlex.join(["python", "scripts/policy_study.py", *(argv or sys.argv[1:])]),
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
