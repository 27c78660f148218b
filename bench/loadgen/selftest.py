"""How many requests/s and streamed tokens/s this load generator can drive on this machine.

Runs in the load generator's process (conveyor bench serve --self-test). Starts the fake server
(``conveyor.bench.loadgen.fake_server``) with zero delays in a child process, runs two closed-loop
phases against it at --max-concurrency (default 64): many short requests (8 output tokens:
bounded by per-request cost) and fewer long streams (256 tokens: bounded by per-chunk cost).
Each phase reports throughput and how many cores the client and the server kept busy; a
client near 1.0 core is the bottleneck (asyncio uses one), so its throughput is what this client
can drive, and a server near 1.0 core means the client can drive at least that much. The
server is stopped at the end, and exits by itself if this process dies.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import time
from typing import Any

from conveyor.bench.loadgen.client import Endpoint
from conveyor.bench.loadgen.datasets import DatasetSpec, PromptMaker, make_dataset
from conveyor.bench.loadgen.metrics import summarize
from conveyor.bench.loadgen.runner import (
    TrafficSpec,
    open_session,
    process_cpu_seconds,
    run_requests,
)
from conveyor.bench.machine import machine_info, system_busy_seconds, tree_cpu_seconds
from conveyor.runtime.processes import python_command

FAKE_SERVER_MODULE = "conveyor.bench.loadgen.fake_server"
PHASES = (("short requests", 8, 1), ("long streams", 256, 4))  # (name, output len, 1/n prompts)


async def start_fake_server(timeout_s: float = 30.0) -> tuple[subprocess.Popen[str], int]:
    """The zero-delay fake server in a child process, and the port it listens on."""
    process = subprocess.Popen(
        python_command(FAKE_SERVER_MODULE, ["--port", "0", "--parent-pid", str(os.getpid())]),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = await asyncio.wait_for(asyncio.to_thread(process.stdout.readline), timeout_s)
    except asyncio.TimeoutError:
        line = ""
    if not line.startswith("PORT="):
        stop_process(process)
        raise RuntimeError(f"the fake server did not start (said {line!r})")
    return process, int(line.strip().split("=", 1)[1])


def stop_process(process: subprocess.Popen[str]) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


async def _phase(
    endpoint: Endpoint, server_pid: int, output_len: int, num_prompts: int, concurrency: int
) -> dict[str, Any]:
    spec = DatasetSpec(name="random", random_input_len=32, random_output_len=output_len)
    samples = make_dataset(spec, num_prompts, seed=0, maker=PromptMaker(None, True))
    traffic = TrafficSpec(max_concurrency=concurrency)
    async with open_session(concurrency, request_timeout_s=300.0) as session:
        client_cpu, server_cpu = process_cpu_seconds(), tree_cpu_seconds(server_pid)
        busy, started = system_busy_seconds(), time.perf_counter()
        run = await run_requests(session, endpoint, samples, traffic, asyncio.Event(), False)
        wall = time.perf_counter() - started
        client_cpu = process_cpu_seconds() - client_cpu
        server_cpu = tree_cpu_seconds(server_pid) - server_cpu
        others = system_busy_seconds() - busy - client_cpu - server_cpu
    result = summarize(run, {}, (99,))
    return {
        "output_len": output_len,
        "num_requests": num_prompts,
        "failed": result["failed"],
        "duration": round(result["duration"], 3),
        "request_throughput": round(result["request_throughput"], 1),
        "output_throughput": round(result["output_throughput"], 1),
        "client_cpu_cores": round(client_cpu / wall, 2),
        "server_cpu_cores": round(server_cpu / wall, 2),
        "p99_itl_ms": round(result["p99_itl_ms"], 3),
        # Cores other processes kept busy meanwhile: numbers are only clean near 0.
        "other_cpu_cores": round(max(0.0, others) / wall, 2),
    }


async def self_test(args: argparse.Namespace) -> dict[str, Any]:
    """Both phases against a fresh fake server; prints a table and returns the numbers."""
    concurrency = args.max_concurrency or 64
    process, port = await start_fake_server()
    phases: dict[str, Any] = {}
    try:
        endpoint = Endpoint(f"http://127.0.0.1:{port}", "fake-model", args.endpoint)
        for name, output_len, divisor in PHASES:
            num_prompts = max(1, args.num_prompts // divisor)
            phases[name] = await _phase(endpoint, process.pid, output_len, num_prompts, concurrency)
    finally:
        stop_process(process)
    print(format_self_test(phases, concurrency))
    return {
        "self_test": phases,
        "max_concurrency": concurrency,
        "endpoint": args.endpoint,
        "machine": machine_info(),
    }


def format_self_test(phases: dict[str, Any], concurrency: int) -> str:
    lines = ["{:=^86}".format(f" Load generator self-test (concurrency {concurrency}) ")]
    lines.append(
        f"{'phase':<16}{'requests':>9}{'tokens':>7}{'req/s':>10}{'tok/s':>11}"
        f"{'client cores':>14}{'server cores':>14}{'others':>8}"
    )
    for name, phase in phases.items():
        lines.append(
            f"{name:<16}{phase['num_requests']:>9}{phase['output_len']:>7}"
            f"{phase['request_throughput']:>10.1f}{phase['output_throughput']:>11.1f}"
            f"{phase['client_cpu_cores']:>14.2f}{phase['server_cpu_cores']:>14.2f}"
            f"{phase['other_cpu_cores']:>8.2f}"
        )
        if phase["failed"]:
            lines.append(f"  {phase['failed']} requests failed: the numbers are not valid")
    lines.append("=" * 86)
    return "\n".join(lines)
