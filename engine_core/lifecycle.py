"""How the engine-core process stops: on signals, with its parent, and how its log lines read.

Runs in the engine-core process (``python -m engine_core``). A child that outlives its parent is an
orphan holding memory, sockets and workers, so the engine is tied to the process that started it
twice over (the kernel's parent-death signal and a thread polling the parent pid, both from
``engine_core.process_utils``); either one ends in the same clean stop as a SIGTERM.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from types import FrameType

from engine_core.process_utils import set_parent_death_signal, watch_parent

LOG_FORMAT = "%(asctime)s {process_name}[%(process)d] %(levelname)s %(name)s: %(message)s"


class ShutdownRequested(BaseException):
    """Raised in the main thread by SIGTERM/SIGINT (or the parent's death).

    A BaseException so that the ``except Exception`` around a failing step cannot mistake a
    requested stop for a fatal error (which would exit non-zero).
    """


def configure_logging(process_name: str, level: int = logging.INFO) -> None:
    """Log lines that say which process wrote them: several processes share one terminal."""
    logging.basicConfig(
        level=level,
        format=LOG_FORMAT.format(process_name=process_name),
        stream=sys.stderr,
        force=True,
    )


def _stop_self() -> None:
    # Through our own SIGTERM handler, so the parent's death gets the usual clean stop.
    os.kill(os.getpid(), signal.SIGTERM)


def tie_to_parent(parent_pid: int | None) -> None:
    """Stop as on SIGTERM when ``parent_pid`` (the process that started us) dies."""
    if parent_pid is None:
        return
    # SIGTERM rather than SIGKILL: the engine must get to stop its own workers.
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent_pid:
        # The parent died before prctl ran: the kernel will never send the signal.
        _stop_self()
        return
    watch_parent(parent_pid, _stop_self)


def install_shutdown_signals() -> None:
    """SIGTERM/SIGINT raise ``ShutdownRequested`` in the main thread, once.

    Raising (rather than setting a flag) also interrupts a step that waits on a hung worker.
    Later signals are ignored, so the cleanup that follows cannot be interrupted half-way.
    """

    def handler(signum: int, frame: FrameType | None) -> None:
        ignore_shutdown_signals()
        raise ShutdownRequested(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def ignore_shutdown_signals() -> None:
    """From here on SIGTERM/SIGINT do nothing (main thread only); a launcher escalates to SIGKILL."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
