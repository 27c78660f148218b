"""Soak test: a real server under 70 % of its capacity for M minutes, watched for leaks.

    python -m benchmarks soak --minutes 10 [--model DIR] [--rate R | --fraction 0.7] \
        [--cancel-rate 0.1] [--sample-interval-s 60] [--result-json soak.json]

Runs in its own process. Starts ``conveyor serve --enable-debug-queries`` on the model (the tiny
random-weight test model by default), takes the capacity as --rate or measures it (one saturating burst
of the load generator: its request throughput), then runs ``conveyor bench serve`` at --fraction of
it with --cancel-rate of the streams dropped midway. Every --sample-interval-s it samples the RSS
of every process in the server's tree and the engine's KV usage (from /metrics). At the end it
checks: no failed request (cancellations are not failures), no process grew by more than
--max-rss-growth-mb from the first sample after the warm-up (--warmup-fraction of the run) to the
last one, once the load stopped every KV block is free (the engine's own accounting, asked through
the debug query), and the server exits 0 on SIGTERM. Prints a table, writes --result-json, and
exits 1 if a check failed. The server is always stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.soak.samples import role_of, table, take_sample
from conveyor.frontend.engine_client import MPEngineClient
from conveyor.runtime.processes import descendants

CONVEYOR = [sys.executable, "-m", "conveyor.entrypoints.cli"]

_ENGINE_READY = re.compile(r"^ready: engine_core pid=(\d+) address=(\S+)$")
_HTTP_READY = re.compile(r"^ready: (http://\S+)$")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks soak", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--minutes", type=float, required=True, help="how long the load runs")
    parser.add_argument("--model", default=None, help="default: the tiny test model")
    parser.add_argument("--rate", type=float, default=None, help="capacity in req/s (else probed)")
    parser.add_argument("--fraction", type=float, default=0.7, help="of capacity, for the soak")
    parser.add_argument("--cancel-rate", type=float, default=0.1)
    parser.add_argument("--sample-interval-s", type=float, default=60.0)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--probe-prompts", type=int, default=64, help="size of the capacity burst")
    parser.add_argument("--frontends", type=int, default=1)
    parser.add_argument("--port", type=int, default=0, help="default: a free one")
    parser.add_argument("--serve-args", default="", help="more conveyor serve flags, one string")
    parser.add_argument("--max-rss-growth-mb", type=float, default=32.0)
    parser.add_argument(
        "--warmup-fraction",
        type=float,
        default=0.25,
        help="memory growth counts from the first sample after this part of the run",
    )
    parser.add_argument("--result-json", default=None, metavar="PATH")
    parser.add_argument("--log", default=None, metavar="PATH", help="the server's log")
    parser.add_argument(
        "--work-dir",
        default=None,
        metavar="DIR",
        help="where the run's files go (logs, load reports; made if missing); default: a new "
        "conveyor-soak-* folder in the temporary directory, kept and printed at the end",
    )
    return parser.parse_args(argv)


@dataclass
class Server:
    process: subprocess.Popen[str]
    log: Path
    engine_address: str = ""
    base_url: str = ""
    pids: list[int] = field(default_factory=list)

    def stop(self) -> int | None:
        """SIGTERM (the server drains), then SIGKILL for anything left; the exit code."""
        self.pids = sorted({*self.pids, *descendants(self.process.pid)})
        code = None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                code = self.process.wait(60.0)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5.0)
        for pid in self.pids:
            if role_of(pid) is not None:
                _kill(pid)
        return code if code is not None else self.process.returncode


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(
    args: argparse.Namespace, model: str, log: Path, timeout_s: float = 120.0
) -> Server:
    command = [*CONVEYOR, "serve", "--model", model]
    command += ["--enable-debug-queries", "--frontends", str(args.frontends)]
    command += ["--port", str(args.port or free_port()), *shlex.split(args.serve_args)]
    with log.open("w") as log_file:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log_file, text=True)
    server = Server(process, log)
    lines: queue.Queue[str] = queue.Queue()
    assert process.stdout is not None
    stdout = process.stdout
    threading.Thread(target=lambda: [lines.put(x) for x in stdout], daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not server.base_url:
        if time.monotonic() > deadline or process.poll() is not None:
            server.stop()
            raise RuntimeError(f"conveyor serve did not become ready; see {log}")
        try:
            line = lines.get(timeout=0.2).strip()
        except queue.Empty:
            continue
        if match := _ENGINE_READY.match(line):
            server.engine_address = match[2]
        elif match := _HTTP_READY.match(line):
            server.base_url = match[1]
    server.pids = descendants(process.pid)
    return server


# ---------------------------------------------------------------- load


def run_loadgen(
    server: Server, model: str, out: Path, flags: list[str], timeout_s: float
) -> dict[str, Any]:
    command = [*CONVEYOR, "bench", "serve", "--base-url", server.base_url]
    command += ["--tokenizer", model, "--no-progress", "--result-json", str(out), *flags]
    with (out.parent / f"{out.stem}.log").open("w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=True)
    return json.loads(out.read_text())


def workload(args: argparse.Namespace) -> list[str]:
    return ["--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)]


def probe_capacity(args: argparse.Namespace, server: Server, model: str, work: Path) -> float:
    """The request throughput of one saturating burst: what the server completes flat out."""
    flags = [*workload(args), "--num-prompts", str(args.probe_prompts), "--request-rate", "inf"]
    result = run_loadgen(server, model, work / "probe.json", flags, timeout_s=600)
    if result["failed"]:
        raise RuntimeError(f"the capacity probe had failures: {result['failure_reasons']}")
    return float(result["request_throughput"])


def soak(
    args: argparse.Namespace, server: Server, model: str, rate: float, work: Path, num_blocks: int
) -> tuple[dict[str, Any], list[dict[str, Any]], float]:
    """Run the load while sampling; the load generator's result, the samples, the start time."""
    duration_s = args.minutes * 60.0
    num_prompts = math.ceil(rate * duration_s * 1.5) + 10
    flags = [*workload(args), "--request-rate", f"{rate:.4f}", "--duration", f"{duration_s:.1f}"]
    flags += ["--num-prompts", str(num_prompts), "--cancel-rate", str(args.cancel_rate)]
    flags += ["--seed", "1"]
    out = work / "soak.json"
    command = [*CONVEYOR, "bench", "serve", "--base-url", server.base_url]
    command += ["--tokenizer", model, "--no-progress", "--result-json", str(out), *flags]
    started = time.monotonic()
    samples = [take_sample(server.process.pid, server.base_url, started, num_blocks)]
    with (work / "soak.log").open("w") as log:
        loadgen = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = started + duration_s + 300.0
            next_sample = started + args.sample_interval_s
            while loadgen.poll() is None:
                if time.monotonic() > deadline:
                    raise RuntimeError("the load generator did not finish in time")
                if time.monotonic() >= next_sample:
                    samples.append(
                        take_sample(server.process.pid, server.base_url, started, num_blocks)
                    )
                    next_sample += args.sample_interval_s
                time.sleep(0.1)
        finally:
            if loadgen.poll() is None:
                loadgen.kill()
                loadgen.wait(5.0)
    if loadgen.returncode != 0:
        raise RuntimeError(f"the load generator failed; see {work / 'soak.log'}")
    return json.loads(out.read_text()), samples, started


# ---------------------------------------------------------------- checks and report


def check_all_free(server: Server, timeout_s: float = 30.0) -> str:
    """Empty if the engine's own accounting says every block is free and no request is left."""
    client = MPEngineClient(address=server.engine_address, ready_timeout_s=10.0)
    try:
        client.check_all_free(timeout_s)
    except (AssertionError, TimeoutError) as exc:
        return str(exc)
    finally:
        client.shutdown()
    return ""


def checks(
    args: argparse.Namespace, load: dict[str, Any], samples: list[dict[str, Any]], leftover: str
) -> dict[str, dict[str, Any]]:
    """Each check: ok and what it saw."""
    # Growth counts from the first sample after the warm-up (batch sizes not seen before make
    # the worker's allocator grow: that is filling up, not leaking) to the last, after the load.
    # The warm-up counts from the first sample that saw load: the load generator's own start-up
    # (imports, tokenizer, warm-up requests) takes seconds on a busy machine.
    # A sample saw load if requests ran, or more had finished than before the soak (a capacity
    # probe on the same server finished some already; the count only grows).
    before = samples[0]["finished"]
    loaded = next(
        (s["t_s"] for s in samples if s["running"] or s["waiting"] or s["finished"] > before),
        samples[0]["t_s"],
    )
    warm = loaded + args.warmup_fraction * args.minutes * 60.0
    # No sample after the warm-up: the run was too short to tell, and the check says so by
    # failing, rather than measuring from before the load (start-up growth is not a leak).
    baseline = next((s for s in samples[1:] if s["t_s"] >= warm), samples[-1])
    first, last = baseline["rss_mib"], samples[-1]["rss_mib"]
    growth = {name: round(last.get(name, 0.0) - mib, 1) for name, mib in first.items()}
    return {
        "no_failures": {
            "ok": load["failed"] == 0 and load["completed"] > 0,
            "completed": load["completed"],
            "failed": load["failed"],
            "cancelled": load["cancelled"],
            "failure_reasons": load["failure_reasons"],
        },
        "memory_flat": {
            # A baseline that is the last sample measures nothing: the run was too short.
            "ok": all(g <= args.max_rss_growth_mb for g in growth.values())
            and len(samples) > 2
            and baseline is not samples[-1],
            "growth_mib": growth,
            "from_t_s": baseline["t_s"],
            "limit_mib": args.max_rss_growth_mb,
        },
        "all_blocks_free_after": {
            "ok": leftover == "" and samples[-1]["kv_usage"] == 0.0,
            "engine_says": leftover or "all free",
            "kv_usage": samples[-1]["kv_usage"],
        },
    }


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model = args.model or str(default_model())
    log = Path(args.log) if args.log else work / "serve.log"
    server = start_server(args, model, log)
    try:
        client = MPEngineClient(address=server.engine_address, ready_timeout_s=10.0)
        num_blocks = client.config.cache.num_blocks
        client.shutdown()
        capacity = args.rate if args.rate is not None else probe_capacity(args, server, model, work)
        rate = args.fraction * capacity
        print(f"capacity {capacity:.2f} req/s -> soak at {rate:.2f} req/s for {args.minutes} min")
        load, samples, started = soak(args, server, model, rate, work, num_blocks)
        leftover = check_all_free(server)
        samples.append(
            {
                **take_sample(server.process.pid, server.base_url, started, num_blocks),
                "after_load": True,
            }
        )
    finally:
        exit_code = server.stop()
    results = checks(args, load, samples, leftover)
    results["clean_exit"] = {"ok": exit_code == 0, "exit_code": exit_code}
    keys = ("completed", "failed", "cancelled", "request_throughput", "output_throughput",
            "mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p99_itl_ms", "duration")  # fmt: skip
    return {
        "model": model,
        "minutes": args.minutes,
        "capacity_req_s": capacity,
        "capacity_source": "--rate" if args.rate is not None else "probe",
        "rate_req_s": rate,
        "fraction": args.fraction,
        "cancel_rate": args.cancel_rate,
        "num_kv_blocks": num_blocks,
        "load": {k: load.get(k) for k in keys},
        "samples": samples,
        "checks": results,
        "passed": all(c["ok"] for c in results.values()),
        "server_log": str(log),
    }


def default_model() -> Path:
    from benchmarks.fixtures.model_maker import ensure_model

    return ensure_model()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.minutes <= 0 or args.sample_interval_s <= 0 or not 0 < args.fraction <= 1:
        print("--minutes, --sample-interval-s: > 0; --fraction: in (0, 1]", file=sys.stderr)
        return 2
    if args.work_dir:
        work = Path(args.work_dir)
        work.mkdir(parents=True, exist_ok=True)
    else:
        work = Path(tempfile.mkdtemp(prefix="conveyor-soak-"))
    result = run(args, work)
    print(table(result["samples"]))
    load = result["load"]
    print(
        f"\nload: {load['completed']} completed, {load['failed']} failed, {load['cancelled']} "
        f"cancelled; {load['request_throughput']:.2f} req/s, {load['output_throughput']:.1f} tok/s"
    )
    for name, check in result["checks"].items():
        details = {k: v for k, v in check.items() if k != "ok"}
        print(f"{'PASS' if check['ok'] else 'FAIL'} {name}: {json.dumps(details)}")
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"result: {args.result_json}")
    print(f"files: {work}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
