"""The gate in front of every route: API key, overload and engine-health refusals, status counts.

Runs in an HTTP frontend process. A pure ASGI middleware, so it sees a streamed response to its
very end: a generation request counts as in flight until its last byte is sent (or its client
leaves). Refusals go out before any body is read: 401 on /v1/* without the key (constant-time
compare; /health and /metrics stay open), 503 + Retry-After while the engine is dead or this
frontend drains, 429 + Retry-After when ``max_queued_requests`` generation requests are already
in flight here.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from frontend.server.errors import (
    RETRY_AFTER_OVERLOADED_S,
    RETRY_AFTER_UNAVAILABLE_S,
    ApiError,
    error_response,
)
from frontend.server.serving import ServingState

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


class GateMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        state: Callable[[], ServingState | None],
        api_key: str | None,
        max_queued_requests: int | None,
    ) -> None:
        self.app = app
        self._state = state
        self._api_key = api_key.encode() if api_key else None
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
                metrics.observe_response(message["status"])
            await send(message)

        refusal = self._refusal(scope, state)
        if refusal is not None:
            await error_response(refusal)(scope, receive, send_counted)
            return
        generation = scope["path"] in GENERATION_PATHS
        if generation:
            metrics.num_in_flight += 1
        try:
            await self.app(scope, receive, send_counted)
        except Exception:
            # The 500 for an unexpected error is sent by Starlette's outermost middleware,
            # around this gate: count it here, or failures would be what /metrics never shows.
            if not started:
                metrics.observe_response(500)
            raise
        finally:
            if generation:
                metrics.num_in_flight -= 1

    def _refusal(self, scope: Scope, state: ServingState) -> ApiError | None:
        path: str = scope["path"]
        if self._api_key is not None and path.startswith("/v1") and not self._authorized(scope):
            return ApiError(401, "a valid API key is required (Authorization: Bearer KEY)")
        if path not in GENERATION_PATHS:
            return None
        if state.client.dead_reason is not None:
            message = f"the engine is unavailable: {state.client.dead_reason}"
            return ApiError(503, message, retry_after_s=RETRY_AFTER_UNAVAILABLE_S)
        if state.draining:
            message = "this server is shutting down"
            return ApiError(503, message, retry_after_s=RETRY_AFTER_OVERLOADED_S)
        limit = self._max_queued_requests
        if limit is not None and state.metrics.num_in_flight >= limit:
            message = f"too many requests in flight (the limit is {limit}); retry later"
            return ApiError(429, message, retry_after_s=RETRY_AFTER_OVERLOADED_S)
        return None

    def _authorized(self, scope: Scope) -> bool:
        assert self._api_key is not None
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(
                    token.strip(), self._api_key
                )
        return False
