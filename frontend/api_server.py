"""The OpenAI-compatible HTTP server: the Starlette app, its routes and its uvicorn runner.

Runs in an HTTP frontend process (``python -m frontend``), on a uvloop event loop. At start-up the
app attaches to a running engine as one more ``AsyncEngineClient`` and loads the model's tokenizer
from the directory the engine names; each frontend process is its own engine client, so several
of them (sharing one port through SO_REUSEPORT) add tokenizing and streaming CPU.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health (503 while
the engine is dead, has dropped this frontend or this frontend drains), GET /metrics (Prometheus
text).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from frontend.async_engine_client import AsyncEngineClient
from frontend.engine_session import EngineDeadError
from frontend.http_errors import RETRY_AFTER_UNAVAILABLE_S, ApiError, error_response
from frontend.http_gate import GateMiddleware
from frontend.http_metrics import ServerMetrics
from frontend.openai_protocol import ChatCompletionRequest, CompletionRequest, decode_body
from frontend.openai_responses import ModelCard, ModelList, encode_json
from frontend.serving_chat import create_chat_completion
from frontend.serving_common import ClientDisconnected, ServingState
from frontend.serving_completion import create_completion
from frontend.tokenizer import load_tokenizer
from frontend.validation import context_limit

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20
# nginx's code for "the client closed the request": counted in /metrics, never seen by anyone.
CLIENT_CLOSED_STATUS = 499
_DRAIN_POLL_S = 0.05
_CLOSE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class ServerSettings:
    engine_address: str
    served_model_name: str | None = None
    api_key: str | None = None
    max_queued_requests: int | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    # The engine already runs when a frontend attaches: a wrong address must not hang for long.
    engine_ready_timeout_s: float = 30.0


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or 413 as soon as it is known to exceed ``limit`` (never buffered past it)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(400, "invalid Content-Length header")
        if int(declared) > limit:
            raise ApiError(413, f"the request body exceeds {limit} bytes")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body exceeds {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        # A hang-up mid-upload is the client's choice, not a server error: nothing was sent
        # to the engine yet, and nobody is left to read an answer.
        raise ClientDisconnected() from None
    return b"".join(chunks)


def _serving(request: Request) -> ServingState:
    return request.app.state.serving


async def completions(request: Request) -> Response:
    state = _serving(request)
    body = decode_body(await read_body(request, state.max_request_body_bytes), CompletionRequest)
    return await create_completion(state, body, request.receive)


async def chat_completions(request: Request) -> Response:
    state = _serving(request)
    raw = await read_body(request, state.max_request_body_bytes)
    return await create_chat_completion(
        state, decode_body(raw, ChatCompletionRequest), request.receive
    )


async def models(request: Request) -> Response:
    state = _serving(request)
    card = ModelCard(state.model_name, state.created, context_limit(state.config))
    return Response(encode_json(ModelList([card])), media_type="application/json")


async def health(request: Request) -> Response:
    state = _serving(request)
    client = state.client
    if client.dead_reason is not None:
        status = "engine session lost" if client.session_lost else "engine dead"
        return JSONResponse({"status": status, "reason": client.dead_reason}, 503)
    if state.draining:
        return JSONResponse({"status": "draining"}, 503)
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    state = _serving(request)
    text = state.metrics.render(state.client.stats)
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error_response(ApiError(exc.status_code, str(exc.detail)))


async def _engine_dead(request: Request, exc: Exception) -> Response:
    message = f"the engine is unavailable: {exc}"
    return error_response(ApiError(503, message, retry_after_s=RETRY_AFTER_UNAVAILABLE_S))


async def _client_closed(request: Request, exc: Exception) -> Response:
    return Response(status_code=CLIENT_CLOSED_STATUS)


async def _unexpected(request: Request, exc: Exception) -> Response:
    logger.exception("unexpected error serving %s", request.url.path, exc_info=exc)
    return error_response(ApiError(500, f"internal error: {type(exc).__name__}"))


@contextlib.asynccontextmanager
async def _lifespan(app: Starlette) -> AsyncIterator[None]:
    settings: ServerSettings = app.state.settings
    client = await AsyncEngineClient.start(
        address=settings.engine_address,
        ready_timeout_s=settings.engine_ready_timeout_s,
        client_name=f"http-frontend-{os.getpid()}",
    )
    try:
        # Off the loop: loading a tokenizer takes a while and the engine heartbeat must go on.
        tokenizer = await asyncio.to_thread(load_tokenizer, client.config.model.model)
        model_name = settings.served_model_name or client.config.model.model
        app.state.serving = ServingState(
            client,
            tokenizer,
            model_name,
            ServerMetrics(model_name),
            settings.max_request_body_bytes,
        )
        logger.info("attached to the engine at %s, serving %s", settings.engine_address, model_name)
        yield
    finally:
        await client.shutdown()


def build_app(settings: ServerSettings) -> Starlette:
    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app: Starlette

    def serving_state() -> ServingState | None:
        return getattr(app.state, "serving", None)

    gate = Middleware(
        GateMiddleware,
        state=serving_state,
        api_key=settings.api_key,
        max_queued_requests=settings.max_queued_requests,
    )
    app = Starlette(
        routes=routes,
        middleware=[gate],
        exception_handlers={
            ApiError: _api_error,
            HTTPException: _http_error,
            EngineDeadError: _engine_dead,
            ClientDisconnected: _client_closed,
            Exception: _unexpected,
        },
        lifespan=_lifespan,
    )
    app.state.settings = settings
    return app


class _Server(uvicorn.Server):
    """uvicorn's server, plus a drain on SIGTERM, a ready file and an exit on a lost session.

    Draining keeps the listening socket open, so a new request is answered 503 + Retry-After (by
    the gate; /health says 503 too) rather than refused; requests in flight get up to
    ``drain_timeout_s`` to finish. Those still running then are aborted in the engine and end
    with an error (a 503, or an error event and [DONE] on a stream) before uvicorn closes the
    connections.

    An engine that dropped this frontend (it stalled past the heartbeat timeout) serves it
    nothing more, while its own /health could only say 503 forever: the server stops and
    ``run_server`` returns 1, so that the supervisor starts a frontend that attaches anew.
    """

    def __init__(self, config: uvicorn.Config, ready_file: Path | None, drain_timeout_s: float):
        super().__init__(config)
        self._ready_file = ready_file
        self._drain_timeout_s = drain_timeout_s
        self.session_lost = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        serving = getattr(self.config.app.state, "serving", None)
        if serving is not None:
            serving.draining = True
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        serving: ServingState | None = getattr(self.config.app.state, "serving", None)
        if serving is not None and serving.client.session_lost and not self.session_lost:
            logger.error("the engine dropped this frontend; exiting, to be restarted")
            self.session_lost = True
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
    if state.metrics.num_in_flight:
        logger.info("draining %d requests in flight", state.metrics.num_in_flight)
    while state.metrics.num_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(_DRAIN_POLL_S)
    if state.metrics.num_in_flight:
        logger.warning(
            "drain timeout (%g s): aborting %d requests in flight",
            timeout_s,
            state.metrics.num_in_flight,
        )
        # Goodbye makes the engine abort every request of ours; each open stream ends with
        # an error naming the reason.
        await state.client.shutdown(f"the server shut down (drain timeout {timeout_s:g} s)")


def bind_shared_socket(host: str, port: int) -> socket.socket:
    """A listening socket with SO_REUSEPORT: every frontend on this port gets its own, and the
    kernel spreads new connections across them."""
    family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if hasattr(socket, "SO_REUSEPORT"):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def run_server(
    settings: ServerSettings,
    sock: socket.socket,
    drain_timeout_s: float,
    ready_file: Path | None = None,
) -> int:
    """Serve on ``sock`` until SIGTERM/SIGINT (then drain for up to ``drain_timeout_s``)."""
    config = uvicorn.Config(
        build_app(settings),
        http="httptools",
        lifespan="on",
        log_config=None,
        access_log=False,
        # After our drain only error events and idle connections are left to close.
        timeout_graceful_shutdown=_CLOSE_TIMEOUT_S,
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
    return 0 if server.started and not server.session_lost else 1
