"""Dying with the parent: a child that outlives the process that started it is an orphan holding
memory, sockets and devices.

Runs in every child conveyor process. Three ways, for three kinds of child:
  ``tie_to_parent``        the kernel's parent-death signal plus a thread polling the parent's
                           pid; either one stops us as a SIGTERM would (engine core, frontends);
  ``exit_when_pipe_closes`` a thread reading a pipe the parent holds open and never writes: EOF
                           means the parent is gone, however it died (workers, whose engine may
                           start them from a thread that ends long before it does);
  ``watch_parent``         the pid poll alone, with any action.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from conveyor.runtime.dirs import remove_runtime_dir
from conveyor.runtime.exit_codes import ExitCode

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


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
    os._exit(ExitCode.PARENT_DIED)


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


def _stop_self() -> None:
    # Through our own SIGTERM handler, so the parent's death gets the usual clean stop.
    os.kill(os.getpid(), signal.SIGTERM)


def tie_to_parent(parent_pid: int | None) -> None:
    """Stop as on SIGTERM when ``parent_pid`` (the process that started us) dies."""
    if parent_pid is None:
        return
    # SIGTERM rather than SIGKILL: an engine must get to stop its own workers.
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent_pid:
        # The parent died before prctl ran: the kernel will never send the signal.
        _stop_self()
        return
    watch_parent(parent_pid, _stop_self)


def exit_when_pipe_closes(fd: int, runtime_dir: str | None = None) -> threading.Thread:
    """Exit at once when the pipe ``fd`` reaches EOF: the parent holding its write end is gone.

    A parent that was killed could not remove its runtime folder, so the child does.
    """

    def wait_for_eof() -> None:
        while os.read(fd, 4096):
            pass
        logger.error("the parent process is gone (its pipe closed); exiting")
        if runtime_dir is not None:
            remove_runtime_dir(runtime_dir)
        os._exit(ExitCode.PARENT_DIED)

    thread = threading.Thread(target=wait_for_eof, name="parent-watch", daemon=True)
    thread.start()
    return thread
