"""HTTP errors in the shape OpenAI clients expect: ``{"error": {message, type, param, code}}``,
or on Anthropic's Messages routes the shape Anthropic's clients expect:
``{"type": "error", "error": {type, message}}``.

Runs in an HTTP frontend process. Every failure a handler can foresee is an ``ApiError`` carrying
its status; the server turns it into a JSON body. Messages are truncated, so a body that echoes
part of a huge input (a stop string, a model name) stays small whatever the client sent.
"""

from __future__ import annotations

import msgspec
from starlette.responses import Response

# Long enough for any message we write, short enough that echoed input cannot bloat a response.
MAX_MESSAGE_CHARS = 512
# A 404's list of the routes there are: the server's own words, only the path it echoes is cut.
ROUTE_LIST_CHARS = 2048
_ELLIPSIS = "..."

# OpenAI's "type" for each status we send.
_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


# The routes whose errors take Anthropic's shape (its Messages API: /v1/messages and below).
ANTHROPIC_ROUTES = "/v1/messages"
# Anthropic's "type" for each status we send.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


class AnthropicErrorInfo(msgspec.Struct):
    type: str
    message: str


class AnthropicError(msgspec.Struct, kw_only=True):
    type: str = "error"
    error: AnthropicErrorInfo


def anthropic_error(status: int, message: str, max_chars: int = 0) -> AnthropicError:
    error_type = _ANTHROPIC_TYPES.get(
        status, "invalid_request_error" if status < 500 else "api_error"
    )
    return AnthropicError(
        error=AnthropicErrorInfo(error_type, truncate(message, max_chars or MAX_MESSAGE_CHARS))
    )


def is_anthropic_route(path: str) -> bool:
    return path == ANTHROPIC_ROUTES or path.startswith(ANTHROPIC_ROUTES + "/")


# Seconds a refused client is told to wait: overload passes quickly (a few steps free a slot);
# an engine that is gone or restarting takes longer.
RETRY_AFTER_OVERLOADED_S = 1
RETRY_AFTER_UNAVAILABLE_S = 5


class ApiError(Exception):
    """A failure with an HTTP status; ``param`` names the offending request field, if one."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        retry_after_s: int | None = None,
        max_chars: int = MAX_MESSAGE_CHARS,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        self.max_chars = max_chars


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def truncate(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - len(_ELLIPSIS)] + _ELLIPSIS


def error_body(
    status: int, message: str, param: str | None = None, max_chars: int = MAX_MESSAGE_CHARS
) -> ErrorResponse:
    error_type = _ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "ServerError")
    param = truncate(param, 64) if param is not None else None
    return ErrorResponse(ErrorInfo(truncate(message, max_chars), error_type, param, status))


def error_json(
    status: int, message: str, param: str | None = None, max_chars: int = MAX_MESSAGE_CHARS
) -> bytes:
    return msgspec.json.encode(error_body(status, message, param, max_chars))


def error_response(error: ApiError, path: str = "") -> Response:
    """The error's response; on an Anthropic route (``path``) in Anthropic's shape."""
    headers = {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(error.retry_after_s)
    if is_anthropic_route(path):
        body = msgspec.json.encode(anthropic_error(error.status, error.message, error.max_chars))
    else:
        body = error_json(error.status, error.message, error.param, error.max_chars)
    return Response(
        body,
        status_code=error.status,
        headers=headers,
        media_type="application/json",
    )
