"""Where the frontends' Prometheus metrics live: one folder that every frontend of a server shares.

Runs in an HTTP frontend process, first thing, and in the supervisor. prometheus_client's
multiprocess mode keeps each process's values in memory-mapped files in the folder named by
``PROMETHEUS_MULTIPROC_DIR``; a scrape of any frontend reads every file there, so it reports the
whole server. The library decides on the mode when it is first imported, so the folder must be
named before that: ``ensure_multiprocess_dir`` is called before anything imports the server,
and this module imports prometheus_client only inside ``forget_process`` (the supervisor's).
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path

from conveyor.runtime.dirs import make_runtime_dir, remove_runtime_dir

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


def ensure_multiprocess_dir() -> Path:
    """The folder this process writes its metrics to: the one the supervisor (or the user) named
    in ``PROMETHEUS_MULTIPROC_DIR``, else a private one removed when this process exits."""
    named = os.environ.get(MULTIPROC_DIR_ENV)
    if named:
        path = Path(named)
        path.mkdir(parents=True, exist_ok=True)
        return path
    path = make_runtime_dir(prefix="conveyor-metrics-")
    atexit.register(remove_runtime_dir, path)
    os.environ[MULTIPROC_DIR_ENV] = str(path)
    return path


def make_shared_dir(parent: Path) -> Path:
    """A fresh metrics folder for the frontends a supervisor starts (inside its runtime folder,
    so it goes when that does)."""
    path = parent / "metrics"
    path.mkdir(mode=0o700, exist_ok=False)
    return path


def forget_process(path: Path, pid: int) -> None:
    """A frontend died: drop its live gauges (its requests in flight, its own view of the
    engine), keep its counters and histograms (what it served still counts)."""
    from prometheus_client import multiprocess  # see the module docstring

    multiprocess.mark_process_dead(pid, str(path))
