"""The routes platforms and operators call besides the API itself: vLLM's and SageMaker's.

Runs in an HTTP frontend process, on its event loop.

* ``GET|POST /ping``: SageMaker's health check, the same answer as ``/health``.
* ``POST /invocations``: SageMaker's one inference route, routed by the body's shape as vLLM
  routes it: ``messages`` is a chat completion, ``prompt`` a completion, ``input`` a Responses
  request; each is then served exactly as on its own route.
* ``GET /tokenizer_info``: vLLM's: the tokenizer's configuration (its ``init_kwargs`` without
  file paths), its class and the chat template the server renders with.
* ``GET /v1/models/{model}``: OpenAI's model retrieval (``client.models.retrieve``).
* ``GET /load``: vLLM's ``{"server_load": N}``, the generation requests in flight in the
  frontend that answers (the whole server's count is ``/metrics``'
  ``conveyor:num_http_requests_in_flight``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from conveyor.frontend.input_processor import context_limit
from conveyor.frontend.server.errors import ApiError, bad_request
from conveyor.frontend.server.response_models import ModelCard
from conveyor.frontend.server.serving import ServingState

# The body keys /invocations routes by, in the order it tries them, and the route each means.
INVOCATION_ROUTES = (
    ("messages", "/v1/chat/completions"),
    ("prompt", "/v1/completions"),
    ("input", "/v1/responses"),
)


class _BodyShape(msgspec.Struct):
    """Which of the routing keys a body has; their values are left undecoded."""

    messages: msgspec.Raw = msgspec.Raw()
    prompt: msgspec.Raw = msgspec.Raw()
    input: msgspec.Raw = msgspec.Raw()


def invocation_route(raw: bytes) -> str:
    """The route an /invocations body is served by; 400 when its shape names none."""
    try:
        shape = msgspec.json.decode(raw, type=_BodyShape)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
        # Served by the chat route, whose decoder says what is wrong with the body.
        return INVOCATION_ROUTES[0][1]
    for key, path in INVOCATION_ROUTES:
        if getattr(shape, key):
            return path
    keys = ", ".join(key for key, _ in INVOCATION_ROUTES)
    raise bad_request(f"/invocations routes a body by its keys: it needs one of {keys}")


class ServerLoad(msgspec.Struct):
    server_load: int


def server_load(state: ServingState) -> ServerLoad:
    return ServerLoad(state.num_in_flight)


def model_card(state: ServingState, model: str) -> ModelCard:
    limit = context_limit(state.config)
    if state.loras is not None and model in state.loras.adapters:
        return ModelCard(model, state.created, limit, parent=state.loras.parent_of(model))
    if model not in state.model_names:
        raise ApiError(404, f"the model {model!r} does not exist", "model")
    return ModelCard(model, state.created, limit)


def tokenizer_info(state: ServingState) -> dict[str, Any]:
    """vLLM's /tokenizer_info: what the tokenizer was made with, as JSON, minus file paths."""
    tokenizer = state.tokenizer
    info = {
        key: _json_value(value)
        for key, value in (getattr(tokenizer, "init_kwargs", None) or {}).items()
        if not key.endswith("_file") and key not in ("name_or_path", "chat_template")
    }
    info["tokenizer_class"] = type(tokenizer).__name__
    template = state.inputs.chat_template or getattr(tokenizer, "chat_template", None)
    if template:
        info["chat_template"] = template
    return info


def _json_value(value: Any) -> Any:
    """``value`` as JSON takes it: special tokens (``AddedToken``) by their text, anything else
    JSON does not know by its ``str``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    content = getattr(value, "content", None)
    return content if isinstance(content, str) else str(value)
