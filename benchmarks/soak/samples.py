"""The soak test's measurements: the server's process tree, RSS per process, KV gauges, a table.

Runs in the soak test's process (``python -m benchmarks soak``). Reads /proc (Linux) and the server's /metrics.
"""

from __future__ import annotations

import math
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

from conveyor.runtime.processes import (
    ENGINE_MODULE,
    FRONTEND_MODULE,
    WORKER_MODULE,
    descendants,
)

MIB = 1 << 20


# The modules conveyor's children run as (``python -P -m MODULE``).
_MODULE_ROLES = {
    ENGINE_MODULE.encode(): "engine_core",
    WORKER_MODULE.encode(): "worker",
    FRONTEND_MODULE.encode(): "frontend",
}


def role_of(pid: int) -> str | None:
    """What a process of the server's tree is, from its command line."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    if b"-m" in argv[:-1]:
        role = _MODULE_ROLES.get(argv[argv.index(b"-m") + 1])
        if role is not None:
            return role
    # The supervisor: ``conveyor serve ...`` or ``python -m conveyor.entrypoints.cli serve ...``.
    return "serve" if b"serve" in argv else None


def rss_by_process(root_pid: int) -> dict[str, float]:
    """MiB resident per process of the tree: serve, engine_core, worker-0, frontend-0, ..."""
    counts: dict[str, int] = {}
    rss: dict[str, float] = {}
    for pid in sorted([root_pid, *descendants(root_pid)]):
        role = role_of(pid)
        if role is None:
            continue
        name = role if role in ("serve", "engine_core") else f"{role}-{counts.get(role, 0)}"
        counts[role] = counts.get(role, 0) + 1
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        kib = int(re.search(r"^VmRSS:\s+(\d+)", status, re.M)[1])  # type: ignore[index]
        rss[name] = kib * 1024 / MIB
    return rss


def engine_gauges(base_url: str) -> dict[str, float]:
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    gauges = {}
    for name in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting"):
        match = re.search(rf"^conveyor:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        gauges[name] = float(match[1]) if match else math.nan
    # Every reason together: a count that only grows, so a sample can tell that load has begun
    # even when it catches no request running (short requests at a low rate mostly finish
    # between samples).
    finished = re.findall(r"^conveyor:request_success_total\{[^}]*\} (\S+)$", text, re.M)
    gauges["num_finished"] = sum(float(value) for value in finished)
    return gauges


def take_sample(root_pid: int, base_url: str, started: float, num_blocks: int) -> dict[str, Any]:
    """One row: seconds since ``started``, RSS per process, the engine's KV and queue gauges."""
    gauges = engine_gauges(base_url)
    usage = gauges["kv_cache_usage_perc"]
    return {
        "t_s": round(time.monotonic() - started, 1),
        "rss_mib": rss_by_process(root_pid),
        "kv_usage": usage,
        "free_blocks": round(num_blocks * (1.0 - usage)),
        "running": gauges["num_requests_running"],
        "waiting": gauges["num_requests_waiting"],
        "finished": gauges["num_finished"],
    }


def table(samples: list[dict[str, Any]]) -> str:
    names = list(samples[0]["rss_mib"])
    header = ["t (s)", *[f"{n} MiB" for n in names], "KV used", "free blocks", "running", "waiting"]
    rows = [
        [
            f"{s['t_s']:.0f}",
            *[f"{s['rss_mib'].get(n, math.nan):.1f}" for n in names],
            f"{100 * s['kv_usage']:.1f} %",
            str(s["free_blocks"]),
            f"{s['running']:.0f}",
            f"{s['waiting']:.0f}",
        ]
        for s in samples
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(r) + " |" for r in rows)])
