"""Start an HTTP frontend process (``python -m frontend``), wait until it serves, stop it.

Runs in the supervisor (``scripts/serve.py``). The frontend is told our pid so it stops when we
die, and runs in its own session so a terminal's Ctrl-C reaches only the supervisor. It writes a
ready file once its server accepts connections: with several frontends on one port, asking the
port cannot tell which of them answered, the file can. A frontend holds no state the engine needs
(the engine aborts a dead client's requests), so the supervisor restarts one that died, within a
``RestartBudget``.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from frontend.engine_process import terminate

logger = logging.getLogger(__name__)

_REPO_ROOT = Path(__file__).resolve().parents[1]
_POLL_INTERVAL_S = 0.05


class FrontendStartError(RuntimeError):
    """The frontend exited, or did not serve within the timeout."""


class FrontendProcess:
    """One frontend child. ``start`` it, ``wait_ready``, and always ``stop`` it."""

    def __init__(
        self,
        index: int,
        engine_address: str,
        options: list[str],
        runtime_dir: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        """``options``: more ``python -m frontend`` flags; ``env``: added to the environment
        (secrets such as CONVEYOR_API_KEY go there, not on a command line anyone can read)."""
        self.index = index
        self._env = dict(env or {})
        self.ready_file = runtime_dir / f"frontend-{index}.ready"
        self.command = [sys.executable, "-m", "frontend", "--engine", engine_address]
        self.command += ["--parent-pid", str(os.getpid()), "--ready-file", str(self.ready_file)]
        self.command += options
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None, "not started"
        return self.process.pid

    def start(self) -> FrontendProcess:
        # A restarted frontend must not look ready because the one before it was.
        self.ready_file.unlink(missing_ok=True)
        env = {**os.environ, **self._env}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO_ROOT), env.get("PYTHONPATH")]))
        self.process = subprocess.Popen(self.command, env=env, start_new_session=True)
        logger.info("started frontend %d, pid %d", self.index, self.process.pid)
        return self

    def exit_code(self) -> int | None:
        """None while running; reaps the child once it has exited."""
        return None if self.process is None else self.process.poll()

    def is_ready(self) -> bool:
        return self.ready_file.exists()

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ready_file.exists():
            code = self.exit_code()
            if code is not None:
                raise FrontendStartError(f"frontend {self.index} exited with code {code}")
            if time.monotonic() > deadline:
                raise FrontendStartError(
                    f"frontend {self.index} did not serve in {timeout_s:.0f} s"
                )
            time.sleep(_POLL_INTERVAL_S)

    def request_stop(self) -> None:
        """SIGTERM without waiting: several frontends drain at once, not one after another."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``. Idempotent."""
        if self.process is None:
            return None
        return terminate(self.process, timeout_s)


class RestartBudget:
    """At most ``max_restarts`` restarts within any ``window_s`` seconds.

    A frontend that died once (a bug hit by one request, the OOM killer) is worth restarting; one
    that keeps dying would only hide the fault behind a restart loop.
    """

    def __init__(
        self, max_restarts: int, window_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._clock = clock
        self._times: deque[float] = deque()

    def take(self) -> bool:
        """Count one restart if the budget allows it; False when it is spent."""
        now = self._clock()
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        return True

    @property
    def num_recent(self) -> int:
        return len(self._times)
