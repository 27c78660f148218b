"""SIGTERM and SIGINT as one exception, ``ShutdownRequested``, raised in the main thread.

Runs in the supervisor and the engine core (the frontends let uvicorn handle their signals; the
workers ignore SIGINT and stop when the engine tells them). Raising rather than setting a flag
also interrupts a wait that would otherwise never end (a hung worker, a child loading a model).

A signal that lands while a child is being spawned is held until the spawn is done: raised inside
``Popen`` after the fork, it would lose the child's handle, and the child would run on unknown to
whoever must stop it.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType

_spawning = 0
_held: str | None = None


class ShutdownRequested(BaseException):
    """SIGTERM/SIGINT (or the parent's death): stop cleanly and exit 0.

    A BaseException so that no ``except Exception`` around a failing step or a start-up path can
    mistake a requested stop for a fatal error (which would exit non-zero).
    """


def _handler(signum: int, frame: FrameType | None) -> None:
    global _held
    # Later signals are ignored, so the cleanup that follows cannot be interrupted half-way.
    ignore_shutdown_signals()
    name = signal.Signals(signum).name
    if _spawning:
        _held = name
        return
    raise ShutdownRequested(name)


def install_shutdown_signals() -> None:
    """From here on, the first SIGTERM/SIGINT raises ``ShutdownRequested`` in the main thread."""
    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)


def ignore_shutdown_signals() -> None:
    """From here on SIGTERM/SIGINT do nothing (main thread only); a launcher escalates to SIGKILL."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold a shutdown signal for the duration of the block; raise it as soon as it ends."""
    global _spawning, _held
    _spawning += 1
    try:
        yield
    finally:
        _spawning -= 1
    if not _spawning and _held is not None:
        name, _held = _held, None
        raise ShutdownRequested(name)
