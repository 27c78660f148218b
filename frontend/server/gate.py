"""The gate in front of every route: API key, overload and engine-health refusals, status counts.

Runs in an HTTP frontend process. A pure ASGI middleware, so it sees a streamed response to its
very end: a generation request counts as in flight from the moment its body has arrived until its
last byte is sent (or its client leaves), so slow uploads hold no place. Refusals go out before
any body is read: 401 without one of the keys (constant-time compares; /health, /metrics,
/version, /ping, /load, /openapi.json and /docs stay open), 503 + Retry-After while the engine is dead or this frontend drains, 429 + Retry-After when
``max_queued_requests`` generation requests are already in flight here (checked again when the
body has arrived, so the count never passes the cap). On Anthropic's Messages routes the key may
also come as ``x-api-key``, and refusals take Anthropic's error shape.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conveyor.frontend.server.errors import (
    RETRY_AFTER_OVERLOADED_S,
    RETRY_AFTER_UNAVAILABLE_S,
    ApiError,
    error_response,
    is_anthropic_route,
)
from conveyor.frontend.server.serving import ServingState

GENERATION_PATHS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/invocations",
)
# What needs no API key: probes (SageMaker's /ping, vLLM's /load), the version and the API's
# description. Everything else (/tokenize spends CPU) does.
OPEN_PATHS = frozenset(
    {"/health", "/metrics", "/version", "/ping", "/load", "/openapi.json", "/docs"}
)


def _body_complete(message: Message) -> bool:
    return message["type"] == "http.request" and not message.get("more_body", False)


class GateMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        state: Callable[[], ServingState | None],
        api_keys: tuple[str, ...],
        max_queued_requests: int | None,
    ) -> None:
        self.app = app
        self._state = state
        self._api_keys = tuple(key.encode() for key in api_keys)
        self._max_queued_requests = max_queued_requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self._state()
        if scope["type"] != "http" or state is None:
            await self.app(scope, receive, send)
            return
        metrics = state.metrics
        started = False

        async def send_counted(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if metrics is not None:
                    metrics.observe_response(message["status"])
            await send(message)

        refusal = self._refusal(scope, state)
        if refusal is not None:
            await error_response(refusal, route_path(scope))(scope, receive, send_counted)
            return
        generation = route_path(scope) in GENERATION_PATHS
        counted = False

        async def receive_counted() -> Message:
            # A request counts as in flight from the moment its whole body is here: a client
            # that uploads slowly holds no place meanwhile (its connection has a deadline).
            nonlocal counted
            message = await receive()
            if generation and not counted and _body_complete(message):
                full = self._full(state)
                if full is not None:
                    raise full
                state.num_in_flight += 1
                counted = True
            return message

        try:
            await self.app(scope, receive_counted, send_counted)
        except Exception:
            # The 500 for an unexpected error is sent by Starlette's outermost middleware,
            # around this gate: count it here, or failures would be what /metrics never shows.
            if not started and metrics is not None:
                metrics.observe_response(500)
            raise
        finally:
            if counted:
                state.num_in_flight -= 1

    def _refusal(self, scope: Scope, state: ServingState) -> ApiError | None:
        path = route_path(scope)
        if self._api_keys and path not in OPEN_PATHS and not self._authorized(scope, path):
            how = "x-api-key: KEY or " if is_anthropic_route(path) else ""
            return ApiError(401, f"a valid API key is required ({how}Authorization: Bearer KEY)")
        if path not in GENERATION_PATHS:
            return None
        if state.client.dead_reason is not None:
            message = f"the engine is unavailable: {state.client.dead_reason}"
            return ApiError(503, message, retry_after_s=RETRY_AFTER_UNAVAILABLE_S)
        if state.draining:
            message = "this server is shutting down"
            return ApiError(503, message, retry_after_s=RETRY_AFTER_OVERLOADED_S)
        return self._full(state)

    def _full(self, state: ServingState) -> ApiError | None:
        limit = self._max_queued_requests
        if limit is not None and state.num_in_flight >= limit:
            message = f"too many requests in flight (the limit is {limit}); retry later"
            return ApiError(429, message, retry_after_s=RETRY_AFTER_OVERLOADED_S)
        return None

    def _authorized(self, scope: Scope, path: str) -> bool:
        """A key in ``Authorization: Bearer KEY``, or on Anthropic's routes in ``x-api-key``
        (how Anthropic's clients send it)."""
        x_api_key = is_anthropic_route(path)
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer" and self._matches(token.strip()):
                    return True
            elif name == b"x-api-key" and x_api_key and self._matches(value.strip()):
                return True
        return False

    def _matches(self, token: bytes) -> bool:
        # Every key compared, whichever matches: the time tells nothing about which.
        matches = [hmac.compare_digest(token, key) for key in self._api_keys]
        return any(matches)


def route_path(scope: Scope) -> str:
    """The path the routes see: uvicorn puts --root-path in front of the request's own."""
    path: str = scope["path"]
    root_path: str = scope.get("root_path", "")
    if root_path and path.startswith(root_path + "/"):
        return path[len(root_path) :]
    return path
