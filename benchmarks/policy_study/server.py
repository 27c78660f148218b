"""A conveyor serve child on a free 127.0.0.1 port for the policy study; always stopped.

Runs in the policy study's process. The server and everything it started are stopped on the way
out, by SIGTERM and, if that hangs, SIGKILL of the whole process tree (each pid checked against
its start time, so a reused pid is never hit).
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from conveyor.frontend.engine_args import EngineArgs
from conveyor.runtime.processes import descendants, proc_stat_fields


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
def served(
    args: EngineArgs,
    log: Path,
    timeout_s: float = 180.0,
    extra: Sequence[str] = (),
    started: list[int] | None = None,
) -> Iterator[str]:
    """conveyor serve on a free 127.0.0.1 port (with ``extra`` flags); yields its base URL;
    always stops it all. ``started`` gets the supervisor's pid."""
    command = [sys.executable, "-m", "conveyor.entrypoints.cli", "serve", "--host", "127.0.0.1"]
    command += ["--port", str(free_port()), *engine_flags(args), *extra]
    with log.open("w") as log_file:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=log_file, text=True, start_new_session=True
        )
    if started is not None:
        started.append(process.pid)
    tree: dict[int, str] = {}
    try:
        url = _wait_ready(process, timeout_s)
        tree = _process_tree(process.pid)
        if url is None:
            raise RuntimeError(f"conveyor serve did not become ready; see {log}")
        yield url
    finally:
        tree.update(_process_tree(process.pid))
        _stop(process)
        _kill_leftovers(tree)


def engine_flags(args: EngineArgs) -> list[str]:
    flags = [
        *("--model", str(args.model), "--policy", args.policy),
        *("--max-model-len", str(args.max_model_len)),
        *("--max-num-batched-tokens", str(args.max_num_batched_tokens)),
        *("--max-num-seqs", str(args.max_num_seqs)),
        *("--seed", str(args.seed)),
        "--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching",
    ]
    if args.kv_cache_memory is not None:
        flags += ["--kv-cache-memory", str(args.kv_cache_memory)]
    if args.tbt_slo_ms is not None:
        flags += ["--tbt-slo-ms", f"{args.tbt_slo_ms:g}"]
    if args.trace_steps is not None:
        flags += ["--trace-steps", args.trace_steps]
    return flags


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
