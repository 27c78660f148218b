"""The OpenAI-compatible HTTP app: its routes, its error handlers and its start-up.

Runs in an HTTP frontend process (``python -m conveyor.frontend``), on a uvloop event loop. At start-up the
app attaches to its running engines (an ``EngineGroupClient``: one more client of each
data-parallel engine, routing every request to one of them) and loads the model's tokenizer from
the directory the engines name; each frontend process is its own engine client, so several of them (each on a socket of the
port the supervisor bound) add tokenizing and streaming CPU.

Routes (``API_ROUTES``): POST /v1/completions, POST /v1/chat/completions, GET /v1/models and
/v1/models/{model}, GET /health (503 while no engine serves this frontend, saying why, or while
this frontend drains), GET /metrics (Prometheus text: the whole server's, whichever frontend
answers; 404 with --disable-metrics), POST /tokenize, POST /detokenize, GET /version (vLLM's
shapes), the operator routes of ``operator_routes`` (/ping, /invocations, /tokenizer_info,
/load), and /openapi.json and /docs (``openapi``). An unknown route's 404 names the routes
there are.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from conveyor.frontend.engine_client.engine_group import LOST_LIMIT_S, EngineGroupClient
from conveyor.frontend.engine_client.router import DEFAULT_AFFINITY_MARGIN
from conveyor.frontend.engine_client.session import EngineDeadError
from conveyor.frontend.input_processor import context_limit
from conveyor.frontend.server.chat import create_chat_completion
from conveyor.frontend.server.completions import create_completion
from conveyor.frontend.server.connection import DEFAULT_MAX_REQUEST_BODY_BYTES
from conveyor.frontend.server.errors import (
    RETRY_AFTER_UNAVAILABLE_S,
    ROUTE_LIST_CHARS,
    ApiError,
    error_response,
    truncate,
)
from conveyor.frontend.server.gate import GateMiddleware, route_path
from conveyor.frontend.server.http_options import HttpOptions, outer_middleware
from conveyor.frontend.server.lora_modules import (
    RUNTIME_UPDATES_ENV,
    LoadLoRAAdapterRequest,
    LoRAModule,
    LoRARegistry,
    UnloadLoRAAdapterRequest,
    load_adapter,
    unload_adapter,
)
from conveyor.frontend.server.messages import count_tokens, create_message
from conveyor.frontend.server.messages_models import (
    CountTokensRequest,
    MessageObject,
    MessagesRequest,
    TokenCount,
)
from conveyor.frontend.server.metrics import PUBLISH_INTERVAL_S, FrontendMetrics
from conveyor.frontend.server.openapi import ApiRoute, docs_page, openapi_spec, shown_path
from conveyor.frontend.server.operator_routes import (
    ServerLoad,
    invocation_route,
    model_card,
    server_load,
    tokenizer_info,
)
from conveyor.frontend.server.request_log import RequestLogger
from conveyor.frontend.server.request_models import (
    ChatCompletionRequest,
    CompletionRequest,
    decode_body,
    decode_large_body,
)
from conveyor.frontend.server.response_models import (
    ChatCompletionResponse,
    CompletionResponse,
    ModelCard,
    ModelList,
    encode_json,
)
from conveyor.frontend.server.responses import (
    cancel_response,
    create_response,
    delete_response,
    get_response,
)
from conveyor.frontend.server.responses_models import ResponseObject, ResponsesRequest
from conveyor.frontend.server.responses_store import ResponsesStore, StoreLimits, store_folder
from conveyor.frontend.server.serving import (
    MAX_CHOICES_PER_REQUEST,
    ClientDisconnected,
    ServingState,
)
from conveyor.frontend.server.tokenize import (
    DetokenizeRequest,
    TokenizeRequest,
    detokenize,
    package_version,
    tokenize,
)
from conveyor.frontend.tokenizer import load_tokenizer
from conveyor.protocol import EngineConfig
from conveyor.protocol.lora import AdapterError
from conveyor.runtime.gc_heap import freeze_startup_heap

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Bodies up to this decode on the loop (tens of microseconds); larger ones on the CPU pool.
LOOP_DECODE_LIMIT_BYTES = 64 << 10
# nginx's code for "the client closed the request": counted in /metrics, never seen by anyone.
CLIENT_CLOSED_STATUS = 499


@dataclass(frozen=True)
class ServerSettings:
    # One address per data-parallel engine (engine i at index i).
    engine_addresses: tuple[str, ...]
    # Every name the API takes for the model, the first in responses; empty: the model's path.
    served_model_names: tuple[str, ...] = ()
    # Any of these in "Authorization: Bearer KEY"; empty: no key needed.
    api_keys: tuple[str, ...] = ()
    max_queued_requests: int | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    # The engine already runs when a frontend attaches: a wrong address must not hang for long.
    engine_ready_timeout_s: float = 30.0
    # How long an engine may answer no heartbeat before it counts as down, and how long no
    # engine may answer before this frontend gives up (None: the client's defaults).
    engine_silence_timeout_s: float | None = None
    engine_lost_timeout_s: float | None = None
    enable_metrics: bool = True
    # --enable-log-requests: a line per request at arrival and at the end; --log-prompts: with
    # (the start of) its prompts.
    log_requests: bool = False
    log_prompts: bool = False
    # Which engine serves each request (frontend.engine_client.router).
    router: str = "prefix-affinity"
    router_affinity_margin: float = DEFAULT_AFFINITY_MARGIN
    # TLS, CORS, the root path, uvicorn's log level, X-Request-Id headers.
    http: HttpOptions = HttpOptions()
    # The stored responses of /v1/responses (shared by the server's frontends).
    responses_store: StoreLimits = StoreLimits()
    # LoRA adapters served from the start, and whether the run-time routes load more.
    lora_modules: tuple[LoRAModule, ...] = ()
    allow_runtime_lora_updating: bool = False


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


async def read_request(request: Request, body_type: type[T]) -> T:
    """The body, decoded and type-checked; a large one is decoded off the event loop."""
    raw = await read_body(request, _serving(request).max_request_body_bytes)
    return await decode_request(_serving(request), raw, body_type)


async def decode_request(state: ServingState, raw: bytes, body_type: type[T]) -> T:
    """``raw`` decoded and type-checked; a large body off the event loop."""
    if len(raw) < LOOP_DECODE_LIMIT_BYTES:
        return decode_body(raw, body_type)
    max_prompts = state.inputs.max_choices or MAX_CHOICES_PER_REQUEST
    context = state.inputs.max_model_len  # every message and prompt token takes one of these
    return await state.run_cpu(decode_large_body, raw, body_type, max_prompts, context, context)


async def completions(request: Request) -> Response:
    body = await read_request(request, CompletionRequest)
    return await create_completion(_serving(request), body, request.receive)


async def chat_completions(request: Request) -> Response:
    body = await read_request(request, ChatCompletionRequest)
    return await create_chat_completion(_serving(request), body, request.receive)


async def responses(request: Request) -> Response:
    body = await read_request(request, ResponsesRequest)
    return await _create_response(request, body)


async def _create_response(request: Request, body: ResponsesRequest) -> Response:
    store = request.app.state.responses_store
    return await create_response(_serving(request), store, body, request.receive)


async def stored_response(request: Request) -> Response:
    state, store = _serving(request), request.app.state.responses_store
    response_id = request.path_params["response_id"]
    if request.method == "DELETE":
        return await delete_response(state, store, response_id)
    if request.query_params.get("stream") not in (None, "false"):
        raise ApiError(400, "a stored response is not streamed again here", "stream")
    return await get_response(state, store, response_id)


async def cancel_route(request: Request) -> Response:
    store = request.app.state.responses_store
    return await cancel_response(_serving(request), store, request.path_params["response_id"])


async def messages(request: Request) -> Response:
    body = await read_request(request, MessagesRequest)
    return await create_message(_serving(request), body, request.receive)


async def messages_count_tokens(request: Request) -> Response:
    body = await read_request(request, CountTokensRequest)
    return await count_tokens(_serving(request), body)


async def _chat(request: Request, body: Any) -> Response:
    return await create_chat_completion(_serving(request), body, request.receive)


async def _completion(request: Request, body: Any) -> Response:
    return await create_completion(_serving(request), body, request.receive)


# The generation routes /invocations hands a body to: path -> (request model, handler).
GENERATION_HANDLERS: dict[str, tuple[type[Any], Callable[[Request, Any], Awaitable[Response]]]] = {
    "/v1/chat/completions": (ChatCompletionRequest, _chat),
    "/v1/completions": (CompletionRequest, _completion),
    "/v1/responses": (ResponsesRequest, _create_response),
}


async def invocations(request: Request) -> Response:
    """SageMaker's route: the body's shape picks the generation route that serves it."""
    state = _serving(request)
    raw = await read_body(request, state.max_request_body_bytes)
    if len(raw) < LOOP_DECODE_LIMIT_BYTES:
        path = invocation_route(raw)
    else:
        path = await state.run_cpu(invocation_route, raw)
    body_type, handler = GENERATION_HANDLERS[path]
    return await handler(request, await decode_request(state, raw, body_type))


async def tokenize_route(request: Request) -> Response:
    body = await read_request(request, TokenizeRequest)
    response = await tokenize(_serving(request), body)
    return Response(encode_json(response), media_type="application/json")


async def detokenize_route(request: Request) -> Response:
    body = await read_request(request, DetokenizeRequest)
    response = await detokenize(_serving(request), body)
    return Response(encode_json(response), media_type="application/json")


async def openapi_route(request: Request) -> Response:
    return Response(_spec(request.app), media_type="application/json")


async def docs_route(request: Request) -> Response:
    spec = msgspec.json.decode(_spec(request.app))
    return HTMLResponse(docs_page(spec))


def _spec(app: Starlette) -> bytes:
    """The OpenAPI description, made once (the routes and models never change)."""
    spec = getattr(app.state, "openapi", None)
    if spec is None:
        title = "conveyor: OpenAI- and Anthropic-compatible API"
        spec = app.state.openapi = msgspec.json.encode(
            openapi_spec(API_ROUTES, title, package_version())
        )
    return spec


async def version_route(request: Request) -> Response:
    return JSONResponse({"version": package_version()})


async def models(request: Request) -> Response:
    state = _serving(request)
    limit = context_limit(state.config)
    cards = [ModelCard(name, state.created, limit) for name in state.model_names]
    if state.loras is not None:
        loras = state.loras
        cards += [
            ModelCard(n, state.created, limit, parent=loras.parent_of(n)) for n in loras.adapters
        ]
    return Response(encode_json(ModelList(cards)), media_type="application/json")


def _lora_registry(
    settings: ServerSettings, config: EngineConfig, model_name: str
) -> LoRARegistry | None:
    """The adapters of --lora-modules, each checked: a bad one stops the start-up."""
    if config.lora is None:
        if settings.lora_modules or settings.allow_runtime_lora_updating:
            raise AdapterError("LoRA adapters need an engine started with --enable-lora")
        return None
    registry = LoRARegistry(config, model_name, settings.allow_runtime_lora_updating)
    for module in settings.lora_modules:
        try:
            registry.add(module.name, module.path, module.base_model_name)
        except AdapterError as error:
            raise AdapterError(f"--lora-modules {module.name}: {error}") from None
    return registry


async def load_lora_route(request: Request) -> Response:
    state = _serving(request)
    body = await read_request(request, LoadLoRAAdapterRequest)
    registry = _registry(state)
    # In a thread: an adapter named by its Hugging Face id may be downloaded first, and the
    # event loop serves every other stream meanwhile.
    return PlainTextResponse(await asyncio.to_thread(load_adapter, registry, body))


async def unload_lora_route(request: Request) -> Response:
    state = _serving(request)
    body = await read_request(request, UnloadLoRAAdapterRequest)
    return PlainTextResponse(unload_adapter(_registry(state), body))


def _registry(state: ServingState) -> LoRARegistry:
    if state.loras is None or not state.loras.runtime_updates:
        raise ApiError(
            404,
            f"run-time LoRA updates are off: start with --enable-lora and set "
            f"{RUNTIME_UPDATES_ENV}=true or --allow-runtime-lora-updating",
        )
    return state.loras


async def model_route(request: Request) -> Response:
    card = model_card(_serving(request), request.path_params["model"])
    return Response(encode_json(card), media_type="application/json")


async def tokenizer_info_route(request: Request) -> Response:
    return JSONResponse(tokenizer_info(_serving(request)))


async def load_route(request: Request) -> Response:
    return Response(encode_json(server_load(_serving(request))), media_type="application/json")


async def health(request: Request) -> Response:
    state = _serving(request)
    client = state.client
    reason = client.dead_reason
    if reason is not None:
        return JSONResponse({"status": "engine unavailable", "reason": reason}, 503)
    if state.draining:
        return JSONResponse({"status": "draining"}, 503)
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    state = _serving(request)
    if state.metrics is None:
        raise ApiError(404, "metrics are disabled on this server (--disable-metrics)")
    # Our own numbers first, on the loop (where they are counted); then reading every
    # frontend's files, a millisecond or more, off it.
    state.metrics.publish_engines(state.client.stats_by_engine(), state.num_in_flight)
    text = await state.run_cpu(state.metrics.render)
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


async def _publish_metrics(state: ServingState, metrics: FrontendMetrics) -> None:
    """Keep this frontend's copy of the engine's stats where the other frontends' scrapes see
    it, however rarely this one is scraped."""
    while True:
        await asyncio.sleep(PUBLISH_INTERVAL_S)
        metrics.publish_engines(state.client.stats_by_engine(), state.num_in_flight)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc, route_path(request.scope))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return error_response(_no_route(request))
    return error_response(ApiError(exc.status_code, str(exc.detail)), route_path(request.scope))


def _no_route(request: Request) -> ApiError:
    """A 404 that names the routes there are (so a client on the wrong path sees the right one)."""
    path = truncate(route_path(request.scope), 80)
    served = ", ".join(
        f"{'|'.join(sorted(route.methods - {'HEAD'}))} {shown_path(route.path)}"
        for route in request.app.routes
        if isinstance(route, Route) and route.methods
    )
    message = f"no route {request.method} {path}; this server answers: {served}"
    return ApiError(404, message, max_chars=ROUTE_LIST_CHARS)


async def _engine_dead(request: Request, exc: Exception) -> Response:
    message = f"the engine is unavailable: {exc}"
    error = ApiError(503, message, retry_after_s=RETRY_AFTER_UNAVAILABLE_S)
    return error_response(error, route_path(request.scope))


async def _client_closed(request: Request, exc: Exception) -> Response:
    return Response(status_code=CLIENT_CLOSED_STATUS)


async def _unexpected(request: Request, exc: Exception) -> Response:
    logger.exception("unexpected error serving %s", request.url.path, exc_info=exc)
    error = ApiError(500, f"internal error: {type(exc).__name__}")
    return error_response(error, route_path(request.scope))


@contextlib.asynccontextmanager
async def _lifespan(app: Starlette) -> AsyncIterator[None]:
    settings: ServerSettings = app.state.settings
    client = await EngineGroupClient.start(
        settings.engine_addresses,
        policy=settings.router,
        affinity_margin=settings.router_affinity_margin,
        ready_timeout_s=settings.engine_ready_timeout_s,
        client_name=f"http-frontend-{os.getpid()}",
        silence_limit_s=settings.engine_silence_timeout_s,
        lost_limit_s=settings.engine_lost_timeout_s or LOST_LIMIT_S,
    )
    publisher: asyncio.Task[None] | None = None
    try:
        # Off the loop: loading a tokenizer takes a while and the engine heartbeat must go on.
        tokenizer = await asyncio.to_thread(load_tokenizer, client.config.model.tokenizer_dir)
        model_names = settings.served_model_names or (client.config.model.model,)
        model_name = model_names[0]
        metrics = None
        if settings.enable_metrics:
            metrics = FrontendMetrics(client.config, model_name, client.engine_labels)
        request_log = None
        if settings.log_requests:
            request_log = RequestLogger(tokenizer, settings.log_prompts)
        app.state.serving = state = ServingState(
            client,
            tokenizer,
            model_name,
            metrics,
            settings.max_request_body_bytes,
            request_log,
            model_names=model_names,
            loras=_lora_registry(settings, client.config, model_name),
        )
        limits = settings.responses_store
        folder = store_folder() if limits.enabled else Path()
        app.state.responses_store = ResponsesStore(folder, limits)
        if metrics is not None:
            publisher = asyncio.create_task(_publish_metrics(state, metrics))
        freeze_startup_heap()
        logger.info(
            "attached to %s at %s, serving %s",
            "the engine" if client.num_engines == 1 else f"{client.num_engines} engines",
            ", ".join(settings.engine_addresses),
            " = ".join(model_names),
        )
        yield
    finally:
        if publisher is not None:
            publisher.cancel()
        serving = getattr(app.state, "serving", None)
        if serving is not None:
            serving.close()
        await client.shutdown()


_GET, _POST = ("GET",), ("POST",)
# Every route of the app (and so of /openapi.json).
API_ROUTES = (
    ApiRoute(
        "/v1/completions",
        _POST,
        completions,
        "A completion (OpenAI); stream: true for server-sent events",
        CompletionRequest,
        CompletionResponse,
    ),
    ApiRoute(
        "/v1/chat/completions",
        _POST,
        chat_completions,
        "A chat completion (OpenAI); stream: true for server-sent events",
        ChatCompletionRequest,
        ChatCompletionResponse,
    ),
    ApiRoute(
        "/v1/responses",
        _POST,
        responses,
        "A response (OpenAI's Responses API); stream: true for its events",
        ResponsesRequest,
        ResponseObject,
    ),
    ApiRoute(
        "/v1/responses/{response_id}",
        ("GET", "DELETE"),
        stored_response,
        "A stored response, or delete it",
        response=ResponseObject,
    ),
    ApiRoute(
        "/v1/responses/{response_id}/cancel",
        _POST,
        cancel_route,
        "Cancel a background response (there are none here: 400, or 404 for an unknown id)",
    ),
    ApiRoute(
        "/v1/messages",
        _POST,
        messages,
        "A message (Anthropic's Messages API); stream: true for its events",
        MessagesRequest,
        MessageObject,
    ),
    ApiRoute(
        "/v1/messages/count_tokens",
        _POST,
        messages_count_tokens,
        "The input tokens of a message request (Anthropic's)",
        CountTokensRequest,
        TokenCount,
    ),
    ApiRoute("/v1/models", _GET, models, "The served model's names", response=ModelList),
    ApiRoute("/v1/models/{model:path}", _GET, model_route, "One model", response=ModelCard),
    ApiRoute(
        "/v1/load_lora_adapter",
        _POST,
        load_lora_route,
        "Serve one more LoRA adapter (vLLM's; with run-time LoRA updating on)",
        LoadLoRAAdapterRequest,
    ),
    ApiRoute(
        "/v1/unload_lora_adapter",
        _POST,
        unload_lora_route,
        "Stop serving a LoRA adapter (vLLM's; with run-time LoRA updating on)",
        UnloadLoRAAdapterRequest,
    ),
    ApiRoute("/health", _GET, health, "200 while an engine serves this frontend, else 503"),
    ApiRoute("/ping", ("GET", "POST"), health, "SageMaker's health check: as /health"),
    ApiRoute(
        "/invocations",
        _POST,
        invocations,
        "SageMaker's inference route: a chat completion (messages), a completion (prompt) "
        "or a response (input), by the body's keys",
        tuple(body_type for body_type, _ in GENERATION_HANDLERS.values()),
    ),
    ApiRoute("/metrics", _GET, metrics, "Prometheus metrics of the whole server"),
    ApiRoute("/load", _GET, load_route, "Generation requests in flight here", response=ServerLoad),
    ApiRoute("/tokenize", _POST, tokenize_route, "Tokenize a prompt or a chat", TokenizeRequest),
    ApiRoute("/detokenize", _POST, detokenize_route, "Token ids to text", DetokenizeRequest),
    ApiRoute("/tokenizer_info", _GET, tokenizer_info_route, "The tokenizer's configuration"),
    ApiRoute("/version", _GET, version_route, "The server's version"),
    ApiRoute("/openapi.json", _GET, openapi_route, "This description of every route and field"),
    ApiRoute("/docs", _GET, docs_route, "This description as a page"),
)


def build_app(settings: ServerSettings) -> Starlette:
    routes = [Route(r.path, r.endpoint, methods=list(r.methods)) for r in API_ROUTES]
    app: Starlette

    def serving_state() -> ServingState | None:
        return getattr(app.state, "serving", None)

    gate = Middleware(
        GateMiddleware,
        state=serving_state,
        api_keys=settings.api_keys,
        max_queued_requests=settings.max_queued_requests,
    )
    app = Starlette(
        routes=routes,
        middleware=[*outer_middleware(settings.http), gate],
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
