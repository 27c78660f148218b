"""Stop this frontend process when the process that started it dies.

Runs in an HTTP frontend process started by ``scripts/serve.py``. The frontend may not import the
engine core, so this is the frontend's own small twin of ``engine_core.lifecycle.tie_to_parent``:
the kernel's parent-death signal (Linux prctl) where available, and a thread that notices the
re-parenting everywhere (it also covers a parent that died before prctl ran). Both end in SIGTERM
to ourselves, the same graceful stop as a supervisor's.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_POLL_INTERVAL_S = 0.5


def _stop_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def _set_parent_death_signal(signum: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def tie_to_parent(parent_pid: int | None) -> None:
    """SIGTERM ourselves when ``parent_pid`` (our parent) is gone; nothing if it is None."""
    if parent_pid is None:
        return
    _set_parent_death_signal(signal.SIGTERM)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_POLL_INTERVAL_S)
        logger.error("parent process %d is gone; stopping", parent_pid)
        _stop_self()

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
