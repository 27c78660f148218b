"""Process-tree helpers for tests that kill things: who descends from a pid, and are they gone.

Runs in the test process. Reads /proc (Linux), so no psutil is needed. A zombie (exited, not yet
reaped by its parent) counts as gone: it holds no memory, sockets or devices.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable

from conveyor.runtime.processes import descendants, proc_stat_fields

__all__ = ["descendants", "is_running", "kill_all", "wait_until_gone"]


def is_running(pid: int) -> bool:
    fields = proc_stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


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
