"""Child-process plumbing: a private runtime folder, stopping children, noticing a dead parent.

Runs in whichever process starts or is started as a conveyor process (the engine core, the
supervisor). Plain Python, no torch. Worker processes cannot import the engine core; they watch
the engine through their stdin pipe instead (``worker.worker_process.watch_parent``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

# Exit status of a process that noticed its parent is gone.
PARENT_DIED_EXIT_CODE = 70
_PR_SET_PDEATHSIG = 1


def make_runtime_dir(prefix: str = "conveyor-") -> Path:
    """A fresh folder only this user can enter (0700), for ipc:// sockets and rendezvous files.

    Short paths matter: a Unix socket path must fit in about 107 bytes.
    """
    base = os.environ.get("XDG_RUNTIME_DIR")
    if not base or not os.access(base, os.W_OK):
        base = None
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    path.chmod(0o700)
    return path


def remove_runtime_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def terminate_processes(
    processes: Sequence[subprocess.Popen[bytes]], grace_s: float = 3.0, kill_wait_s: float = 5.0
) -> None:
    """SIGTERM every live child, SIGKILL those still alive after ``grace_s``, then reap them all.

    Never waits unbounded: a child that survives SIGKILL for ``kill_wait_s`` (stuck in the
    kernel) is logged and left; everything else is reaped, so no zombie remains.
    """
    live = [p for p in processes if p.poll() is None]
    for process in live:
        _signal(process, signal.SIGTERM)
    live = wait_for_exit(live, grace_s)
    for process in live:
        logger.warning("pid %d ignored SIGTERM for %.1f s; sending SIGKILL", process.pid, grace_s)
        _signal(process, signal.SIGKILL)
    for process in wait_for_exit(live, kill_wait_s):
        logger.error("pid %d survived SIGKILL; leaving it", process.pid)


def _signal(process: subprocess.Popen[bytes], signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signum)


def wait_for_exit(
    processes: Sequence[subprocess.Popen[bytes]], timeout_s: float
) -> list[subprocess.Popen[bytes]]:
    """Poll until every process exited or the time is up; returns those still running."""
    deadline = time.monotonic() + timeout_s
    live = [p for p in processes if p.poll() is None]
    while live and time.monotonic() < deadline:
        time.sleep(0.01)
        live = [p for p in live if p.poll() is None]
    return live


def set_parent_death_signal(signum: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``signum`` to this process when its parent dies (prctl PDEATHSIG).

    The signal comes when the parent *thread* that started this process exits, so callers also
    run ``watch_parent``. Returns False where prctl is unavailable.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _exit_parent_died() -> None:
    os._exit(PARENT_DIED_EXIT_CODE)


def watch_parent(
    expected_ppid: int,
    on_death: Callable[[], None] = _exit_parent_died,
    interval_s: float = 0.5,
) -> threading.Thread:
    """Call ``on_death`` (default: exit at once) when the parent process goes away.

    A daemon thread compares ``os.getppid()`` with the pid of the parent that started us: when
    that parent dies this process is re-parented and the pid changes. Portable, and it also
    covers a parent that died before ``set_parent_death_signal`` ran.
    """

    def watch() -> None:
        while os.getppid() == expected_ppid:
            time.sleep(interval_s)
        logger.error("parent process %d is gone; exiting", expected_ppid)
        on_death()

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


def proc_stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...); None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    return text.rsplit(")", 1)[1].split()


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, grandchildren, ...), from /proc (Linux).

    A zombie (exited, not yet reaped) is not live: it holds no memory, sockets or devices.
    """
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = proc_stat_fields(int(entry))
        if fields is not None and fields[0] not in ("Z", "X"):
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, frontier = [], [pid]
    while frontier:
        below = children.get(frontier.pop(), [])
        found += below
        frontier += below
    return found
