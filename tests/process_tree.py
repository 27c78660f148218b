"""Process-tree helpers for tests that kill things: who descends from a pid, and are they gone.

Runs in the test process. Reads /proc (Linux), so no psutil is needed. A zombie (exited, not yet
reaped by its parent) counts as gone: it holds no memory, sockets or devices.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from pathlib import Path


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    return text.rsplit(")", 1)[1].split()


def is_running(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, grandchildren, ...)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(int(entry))
        if fields is not None and fields[0] not in ("Z", "X"):
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, frontier = [], [pid]
    while frontier:
        below = children.get(frontier.pop(), [])
        found += below
        frontier += below
    return found


def wait_until_gone(pids: Iterable[int], timeout_s: float) -> list[int]:
    """Poll until none of ``pids`` runs; returns those still running at the timeout."""
    deadline = time.monotonic() + timeout_s
    alive = [p for p in pids if is_running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if is_running(p)]
    return alive


def kill_all(pids: Iterable[int]) -> None:
    """Last-resort cleanup for a failed test: SIGKILL whatever is left."""
    for pid in pids:
        if is_running(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
