"""Fixtures for the load generator's tests: a fake server, in this process or in a child.

The fake server (``python -m benchmarks fake-server``) runs on its own event loop in a background
thread, so a test can drive it with the load generator's own asyncio.run / main() and read the
server's counters directly; or in a child process, where its timing does not share the test's
GIL. Every server a test starts is stopped when the test ends.
"""

from __future__ import annotations

import asyncio
import os
import select
import subprocess
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from conveyor.bench.loadgen.fake_server import FakeServer, FakeServerConfig, FakeServerStats
from conveyor.runtime.processes import terminate_processes
from tests.commands import CHECKOUT, LAB


class ServerThread:
    """A FakeServer listening on 127.0.0.1 from a daemon thread's event loop."""

    def __init__(self, config: FakeServerConfig) -> None:
        self.server = FakeServer(config)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = self._call(self.server.start())

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def stats(self) -> FakeServerStats:
        return self.server.stats

    def _call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=10)

    def stop(self) -> None:
        if not self.loop.is_running():
            return
        self._call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture
def fake_server() -> Iterator[Callable[..., ServerThread]]:
    """fake_server(**FakeServerConfig fields) -> a running ServerThread."""
    started: list[ServerThread] = []

    def start(**config: Any) -> ServerThread:
        started.append(ServerThread(FakeServerConfig(**config)))
        return started[-1]

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def fake_server_process() -> Iterator[Callable[..., str]]:
    """fake_server_process(*cli_flags) -> the base URL of a fake server in a child process."""
    started: list[subprocess.Popen[str]] = []

    def start(*flags: str) -> str:
        command = [*LAB, "fake-server", "--port", "0"]
        command += ["--max-lifetime-s", "300", "--parent-pid", str(os.getpid()), *flags]
        started.append(subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=CHECKOUT))
        ready, _, _ = select.select([started[-1].stdout], [], [], 30)
        line = started[-1].stdout.readline() if ready else ""
        assert line.startswith("PORT="), f"the fake server did not start: {line!r}"
        return f"http://127.0.0.1:{line.strip().split('=', 1)[1]}"

    yield start
    terminate_processes(started, grace_s=10.0)
