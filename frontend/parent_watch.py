"""Stop this frontend process when the process that started it dies.

Runs in an HTTP frontend process started by ``scripts/serve.py``. The same two guards as the
engine core's (the kernel's parent-death signal where available, and a thread that notices the
re-parenting everywhere, which also covers a parent that died before prctl ran), but both end in
SIGTERM to ourselves rather than an immediate exit: a frontend stops the way a supervisor stops
it, closing its streams and saying Goodbye to the engine.
"""

from __future__ import annotations

import os
import signal

from engine_core.process_utils import set_parent_death_signal, watch_parent


def _stop_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def tie_to_parent(parent_pid: int | None) -> None:
    """SIGTERM ourselves when ``parent_pid`` (our parent) is gone; nothing if it is None."""
    if parent_pid is None:
        return
    set_parent_death_signal(signal.SIGTERM)
    watch_parent(parent_pid, on_death=_stop_self)
