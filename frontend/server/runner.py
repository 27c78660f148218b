"""Running the app: uvicorn on the server's listening socket, a drain on SIGTERM, a ready file,
exit codes.

Runs in an HTTP frontend process (``python -m conveyor.frontend``), on a uvloop event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import uvicorn

from conveyor.frontend.server.app import ServerSettings, build_app
from conveyor.frontend.server.connection import ConnectionLimits, guarded_protocol
from conveyor.frontend.server.http_options import uvicorn_settings
from conveyor.frontend.server.serving import ServingState
from conveyor.runtime.exit_codes import ExitCode
from conveyor.runtime.listen import bind_listening_socket

logger = logging.getLogger(__name__)

_DRAIN_POLL_S = 0.05
_CLOSE_TIMEOUT_S = 2.0


class _Server(uvicorn.Server):
    """uvicorn's server, plus a drain on SIGTERM, a ready file and an exit when the engines are
    lost for good.

    Draining keeps the listening socket open, so a new request is answered 503 + Retry-After (by
    the gate; /health says 503 too) rather than refused; requests in flight get up to
    ``drain_timeout_s`` to finish. Those still running then are aborted in the engine and end
    with an error (a 503, or an error event and [DONE] on a stream) before uvicorn closes the
    connections.

    An engine that went silent, or dropped this frontend, is attached again by the client as
    soon as it answers. One that has not answered for the client's limit (``lost_reason``)
    will not: rather than answer 503 forever the server stops and ``run_server`` returns
    ``ENGINE_LOST``, on which the supervisor stops everything.
    """

    def __init__(self, config: uvicorn.Config, ready_file: Path | None, drain_timeout_s: float):
        super().__init__(config)
        self._ready_file = ready_file
        self._drain_timeout_s = drain_timeout_s
        self.engine_lost = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        serving = getattr(self.config.app.state, "serving", None)
        if serving is not None:
            serving.draining = True
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        serving: ServingState | None = getattr(self.config.app.state, "serving", None)
        if serving is not None and serving.client.lost_reason and not self.engine_lost:
            logger.error("%s; exiting", serving.client.lost_reason)
            self.engine_lost = True
            self.should_exit = True
        return await super().on_tick(counter)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self._ready_file is not None:
            self._ready_file.write_text(f"{os.getpid()}\n")

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        serving: ServingState | None = getattr(self.config.app.state, "serving", None)
        if serving is not None and not self.force_exit:
            await drain(serving, self._drain_timeout_s)
        await super().shutdown(sockets)


async def drain(state: ServingState, timeout_s: float) -> None:
    """Wait (bounded) for the generation requests in flight; abort whatever is left."""
    deadline = time.monotonic() + timeout_s
    if state.num_in_flight:
        logger.info("draining %d requests in flight", state.num_in_flight)
    while state.num_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(_DRAIN_POLL_S)
    if state.num_in_flight:
        logger.warning(
            "drain timeout (%g s): aborting %d requests in flight",
            timeout_s,
            state.num_in_flight,
        )
        # Goodbye makes the engine abort every request of ours; each open stream ends with
        # an error naming the reason.
        await state.client.shutdown(f"the server shut down (drain timeout {timeout_s:g} s)")


def listening_socket(host: str, port: int, inherited_fd: int | None = None) -> socket.socket:
    """The socket this frontend accepts on: the one ``conveyor serve`` bound for it and handed
    down (``inherited_fd``), else one of its own on ``host``:``port``."""
    if inherited_fd is not None:
        sock = socket.socket(fileno=inherited_fd)
    else:
        sock = bind_listening_socket(host, port)
    sock.setblocking(False)
    return sock


def run_server(
    settings: ServerSettings,
    sock: socket.socket,
    drain_timeout_s: float,
    ready_file: Path | None = None,
    limits: ConnectionLimits | None = None,
    access_log: bool = False,
) -> int:
    """Serve on ``sock`` until SIGTERM/SIGINT (then drain for up to ``drain_timeout_s``)."""
    limits = limits or ConnectionLimits(max_body_bytes=settings.max_request_body_bytes)
    config = uvicorn.Config(
        build_app(settings),
        http=guarded_protocol(limits),
        timeout_keep_alive=int(max(1, limits.idle_timeout_s)),
        lifespan="on",
        log_config=None,
        # Off unless asked for (--enable-access-log): a line per request costs the event loop.
        access_log=access_log,
        # After our drain only error events and idle connections are left to close.
        timeout_graceful_shutdown=_CLOSE_TIMEOUT_S,
        **uvicorn_settings(settings.http),
    )
    server = _Server(config, ready_file, drain_timeout_s)
    # uvicorn re-raises a caught signal once it has stopped; with this handler that re-raise
    # ends nothing, so a drained frontend exits 0.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: None)
    if sys.platform != "win32":
        import uvloop

        uvloop.run(server.serve(sockets=[sock]))
    else:
        asyncio.run(server.serve(sockets=[sock]))
    if server.engine_lost:
        return ExitCode.ENGINE_LOST
    return ExitCode.OK if server.started else ExitCode.FAILED
