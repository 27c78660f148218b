"""Child processes: spawn ``python -P -m <module>``, stop them politely then firmly, scan the tree.

Runs in whichever process starts children: the supervisor (engine core, frontends), the engine core
(workers), an ``LLM`` caller (its engine core). Children are always installed modules started with
this interpreter, never files found relative to a source tree, so an installed conveyor runs from
any directory; and the caller's working directory is kept off their import path, so a
``protocol.py`` or ``conveyor.py`` lying there can never stand in for ours. Every wait here is
bounded.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from conveyor.runtime.signals import signals_held

logger = logging.getLogger(__name__)

_POLL_S = 0.01

# The modules conveyor starts as processes: who starts whom, in one place.
ENGINE_MODULE = "conveyor.entrypoints.engine"  # by the supervisor and by LLM(...)
WORKER_MODULE = "conveyor.worker"  # by the engine core's multi-process executor
FRONTEND_MODULE = "conveyor.frontend"  # by the supervisor
# A model id not in the Hugging Face cache: by whoever resolves it (the supervisor, LLM(...)).
DOWNLOAD_MODULE = "conveyor.frontend.model_download"

# Python 3.10 has no -P: drop the working directory ('' at sys.path[0] under -c) by hand, before
# anything is imported from it, then run the module as -m would.
_RUN_MODULE_WITHOUT_CWD = (
    "import runpy, sys; del sys.path[0]; module = sys.argv.pop(1); "
    "runpy.run_module(module, run_name='__main__', alter_sys=True)"
)


def python_command(module: str, args: Sequence[str] = ()) -> list[str]:
    """``python -m module args...`` with this interpreter, the working directory off the path
    (``-P``, safe-path mode): what lies in the caller's directory is never imported."""
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", module, *args]
    return [sys.executable, "-c", _RUN_MODULE_WITHOUT_CWD, module, *args]


def spawn_module(
    module: str,
    args: Sequence[str] = (),
    *,
    env: dict[str, str] | None = None,
    stdin_pipe: bool = False,
    pass_fds: Sequence[int] = (),
) -> subprocess.Popen[bytes]:
    """Start ``python -P -m module args...`` with this interpreter (``python_command``).

    ``env`` is added to this process's environment (secrets go there, never on a command line
    that every local user can read); ``pass_fds`` stay open in the child under the same numbers
    (every other descriptor is closed there). Each child gets a session of its own: a Ctrl-C in the
    terminal then reaches only the parent, which decides how its children stop, and on Linux each
    is its own scheduling group (autogroup), so one process's busy threads cannot crowd another's
    out. A shutdown signal arriving meanwhile is held until the child's handle exists, and raised
    as this returns: a caller that keeps the handle must store it inside its own
    ``signals_held()`` block.
    """
    command = python_command(module, args)
    stdin = subprocess.PIPE if stdin_pipe else None
    with signals_held():
        return subprocess.Popen(
            command,
            env={**os.environ, **(env or {})},
            start_new_session=True,
            stdin=stdin,
            pass_fds=tuple(pass_fds),
        )


class ChildProcess:
    """One conveyor child. ``start`` it, poll ``exit_code``, and always ``stop`` it."""

    def __init__(
        self,
        name: str,
        module: str,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        pass_fds: Sequence[int] = (),
    ) -> None:
        self.name = name
        self.module = module
        self.args = list(args)
        self.env = dict(env or {})
        self.pass_fds = tuple(pass_fds)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.name} was not started"
        return self.process.pid

    def start(self) -> ChildProcess:
        # Held until the handle is stored: raised as spawn_module returns, the signal would
        # lose it, and the child would run on with nobody to stop it.
        with signals_held():
            self.process = spawn_module(
                self.module, self.args, env=self.env, pass_fds=self.pass_fds
            )
        logger.info("started %s, pid %d", self.name, self.process.pid)
        return self

    def exit_code(self) -> int | None:
        """None while running (or not started); reaps the child once it has exited."""
        return None if self.process is None else self.process.poll()

    def request_stop(self) -> None:
        """SIGTERM without waiting: several children wind down at once, not one after another."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``; the exit code. Idempotent."""
        return None if self.process is None else terminate(self.process, timeout_s)


def terminate(process: subprocess.Popen[bytes], timeout_s: float) -> int | None:
    """Stop a child politely, then firmly; returns its exit code (None if it survived both)."""
    # Popen's send_signal and kill do nothing for a child that has already been reaped.
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        logger.warning("pid %d ignored SIGTERM for %.0f s: killing it", process.pid, timeout_s)
    process.kill()
    try:
        return process.wait(5.0)
    except subprocess.TimeoutExpired:
        return None


def terminate_processes(
    processes: Sequence[subprocess.Popen], grace_s: float = 3.0, kill_wait_s: float = 5.0
) -> None:
    """SIGTERM every live child, SIGKILL those still alive after ``grace_s``, then reap them all.

    A child that survives SIGKILL for ``kill_wait_s`` (stuck in the kernel) is logged and left;
    everything else is reaped, so no zombie remains.
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


def _signal(process: subprocess.Popen, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signum)


def wait_for_exit(
    processes: Sequence[subprocess.Popen], timeout_s: float
) -> list[subprocess.Popen]:
    """Poll until every process exited or the time is up; returns those still running."""
    deadline = time.monotonic() + timeout_s
    live = [p for p in processes if p.poll() is None]
    while live and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        live = [p for p in live if p.poll() is None]
    return live


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def proc_stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...); None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    return text.rsplit(")", 1)[1].split()


def pid_is_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (a killed child its parent has not reaped)."""
    fields = proc_stat_fields(pid)
    if fields is not None:
        return fields[0] not in ("Z", "X")
    try:  # gone, or no readable /proc: ask the kernel
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
