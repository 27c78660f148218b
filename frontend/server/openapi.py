"""The server's route table, and the OpenAPI description made from it.

Runs in an HTTP frontend process. Every route the app serves is an ``ApiRoute``: its path,
methods, handler, a one-line summary, and the request model its handler decodes (a msgspec
Struct, whose fields are exactly what the route accepts: an unknown one is a 400).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response


@dataclass(frozen=True)
class ApiRoute:
    path: str
    methods: tuple[str, ...]
    endpoint: Callable[[Request], Awaitable[Response]]
    summary: str
    # The request model the handler decodes the body into (None: no body); a tuple: one of
    # them, chosen by the body's shape.
    body: Any = None
    # The model of a 200 answer (None: described by the summary only).
    response: Any = None


def shown_path(path: str) -> str:
    """A route's path as clients read it: ``/v1/models/{model}``, not Starlette's
    ``{model:path}`` (a parameter that may hold slashes, as model ids do)."""
    return path.replace(":path}", "}")
