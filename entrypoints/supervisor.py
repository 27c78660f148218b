"""The supervisor's children: frontend processes, a restart budget, watching and stopping them all.

Runs in the supervisor (``conveyor serve``). A frontend is told our pid so it stops when we die,
and runs in its own session so a terminal's Ctrl-C reaches only the supervisor. It writes a ready
file once its server accepts connections: with several frontends on one port, asking the port
cannot tell which of them answered, the file can. A frontend holds no state the engine needs (the
engine aborts a dead client's requests), so a dead one is restarted, within a ``RestartBudget``,
unless it exited for having heard no engine for too long (then everything stops).
With one engine core, its death stops everything; with several (data parallelism), a dead one is
restarted in place within a budget of its own while the others serve (``engines``).
"""

from __future__ import annotations

import http.client
import logging
import os
import ssl
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from pathlib import Path

from conveyor.entrypoints.engines import restart_engine
from conveyor.frontend.engine_client import EngineProcess
from conveyor.frontend.server.metrics_dir import forget_process
from conveyor.runtime.exit_codes import ExitCode
from conveyor.runtime.listen import ListeningSockets
from conveyor.runtime.processes import FRONTEND_MODULE, ChildProcess

logger = logging.getLogger(__name__)

_POLL_INTERVAL_S = 0.05
_WATCH_INTERVAL_S = 0.2


class FrontendStartError(RuntimeError):
    """The frontend exited, or did not serve within the timeout."""


class FrontendProcess(ChildProcess):
    """One HTTP frontend child (``python -m conveyor.frontend``). ``start`` it, ``wait_ready``, ``stop`` it."""

    def __init__(
        self,
        index: int,
        engine_addresses: list[str],
        options: list[str],
        runtime_dir: Path,
        env: dict[str, str] | None = None,
        metrics_dir: Path | None = None,
        listen_fd: int | None = None,
    ) -> None:
        """``options``: more frontend flags; ``env``: added to the environment (secrets such as
        CONVEYOR_API_KEY go there, not on a command line anyone can read); ``metrics_dir``: the
        Prometheus folder every frontend shares (None: metrics disabled); ``listen_fd``: the
        listening socket the supervisor bound, which the frontend inherits and accepts on
        (None: it binds --host/--port itself)."""
        self.index = index
        self.metrics_dir = metrics_dir
        self.ready_file = runtime_dir / f"frontend-{index}.ready"
        args = [arg for address in engine_addresses for arg in ("--engine", address)]
        args += ["--parent-pid", str(os.getpid())]
        args += ["--ready-file", str(self.ready_file), *options]
        pass_fds: tuple[int, ...] = ()
        if listen_fd is not None:
            args += ["--listen-fd", str(listen_fd)]
            pass_fds = (listen_fd,)
        super().__init__(f"frontend-{index}", FRONTEND_MODULE, args, env, pass_fds)

    def start(self) -> FrontendProcess:
        # A restarted frontend must not look ready because the one before it was.
        self.ready_file.unlink(missing_ok=True)
        if self.process is not None and self.metrics_dir is not None:
            # The one before it is dead: its live gauges (requests in flight) must not linger.
            forget_process(self.metrics_dir, self.process.pid)
        super().start()
        return self

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


def watch(
    children: dict[str, ChildProcess],
    restarts: RestartBudget,
    engine_restarts: RestartBudget | None = None,
    engine_ready_timeout_s: float = 300.0,
    listening: ListeningSockets | None = None,
) -> str:
    """Block until a child's death must stop everything; returns what happened to it.

    A dead frontend is restarted in place while ``restarts`` allows it, unless it exited
    because no engine answered it for too long (``ENGINE_LOST``: an engine alive but stalled
    for good would leave the server up and refusing everything); so is a dead engine while
    ``engine_restarts`` does (given only with several data-parallel engines: one engine's
    death stops everything). The others keep serving, and new connections go to them alone
    (``listening``) until the dead frontend's replacement serves.
    """
    restarting: set[str] = set()

    def steer() -> None:
        if listening is not None:
            down = {
                c.index
                for n, c in children.items()
                if n in restarting and isinstance(c, FrontendProcess)
            }
            listening.serve_only(i for i in range(listening.count) if i not in down)

    while True:
        for name, child in children.items():
            code = child.exit_code()
            if code is None:
                if name in restarting and isinstance(child, FrontendProcess) and child.is_ready():
                    restarting.discard(name)
                    steer()
                    logger.info("%s serves again (pid %d)", name, child.pid)
                continue
            death = f"{name} (pid {child.pid}) exited with code {code}"
            if code == ExitCode.ENGINE_LOST and isinstance(child, FrontendProcess):
                # No engine answered it for minutes: a new frontend would find the same.
                return f"{death}: no engine answered it for too long"
            budget = _restart_budget(child, restarts, engine_restarts)
            if budget is None:
                return death
            kind = "frontend" if isinstance(child, FrontendProcess) else "engine"
            if not budget.take():
                return (
                    f"{death}, more than {budget.max_restarts} {kind} restarts within "
                    f"{budget.window_s:g} s"
                )
            logger.warning(
                "%s; restarting it (%s restart %d of at most %d within %g s)",
                death, kind, budget.num_recent, budget.max_restarts, budget.window_s,
            )  # fmt: skip
            if isinstance(child, EngineProcess):
                restart_engine(child, engine_ready_timeout_s)
            else:
                restarting.add(name)
                steer()
                child.start()
        time.sleep(_WATCH_INTERVAL_S)


def _restart_budget(
    child: ChildProcess, restarts: RestartBudget, engine_restarts: RestartBudget | None
) -> RestartBudget | None:
    """The budget a dead child is restarted within, or None: its death stops everything."""
    if isinstance(child, FrontendProcess):
        return restarts
    if isinstance(child, EngineProcess):
        return engine_restarts
    return None


def stop_all(
    children: dict[str, ChildProcess], timeout_s: float, drain_timeout_s: float = 0.0
) -> None:
    """Frontends first, all draining at once, then the engines they were streaming from (also
    all at once)."""
    frontends = [c for c in children.values() if isinstance(c, FrontendProcess)]
    for frontend in frontends:
        frontend.request_stop()
    # A frontend's drain is no reason to SIGKILL it: it gets the drain on top of the timeout.
    for frontend in frontends:
        frontend.stop(timeout_s + drain_timeout_s)
    others = [c for c in children.values() if c not in frontends]
    for child in others:
        child.request_stop()
    for child in others:
        child.stop(timeout_s)


def wait_healthy(host: str, port: int, timeout_s: float, scheme: str = "http") -> None:
    """Poll GET /health on the shared port until it answers 200."""
    url = f"{base_url(host, port, scheme)}/health"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urlopen_local(url, timeout_s=2.0) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise FrontendStartError(f"{url} did not answer 200 within {timeout_s:.0f} s")
        time.sleep(0.1)


def base_url(host: str, port: int, scheme: str = "http") -> str:
    """Where a local client reaches frontends listening on ``host`` (a wildcard -> loopback)."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def urlopen_local(url: str | urllib.request.Request, timeout_s: float) -> http.client.HTTPResponse:
    """``urlopen`` of our own frontends, over HTTPS without checking the certificate (it names
    the host clients use, and may be self-signed): the supervisor holds the listening socket,
    so nothing but its own frontends can answer on that port."""
    context = ssl._create_unverified_context()
    return urllib.request.urlopen(url, timeout=timeout_s, context=context)
