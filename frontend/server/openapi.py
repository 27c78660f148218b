"""The server's route table, and the OpenAPI description and docs page made from it.

Runs in an HTTP frontend process. Every route the app serves is an ``ApiRoute``: its path,
methods, handler, a one-line summary, and the request model its handler decodes (a msgspec
Struct, whose fields are exactly what the route accepts: an unknown one is a 400). GET
/openapi.json is that table with each model's JSON schema as msgspec writes it, so it lists
every route and field the server accepts, and cannot drift from them; GET /docs renders it as a
page that needs nothing from outside the server (no scripts from a CDN).
"""

from __future__ import annotations

import html
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from conveyor.frontend.server.errors import AnthropicError, ErrorResponse, is_anthropic_route

REF_TEMPLATE = "#/components/schemas/{name}"


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

    @property
    def body_types(self) -> tuple[Any, ...]:
        if self.body is None:
            return ()
        return self.body if isinstance(self.body, tuple) else (self.body,)


def shown_path(path: str) -> str:
    """A route's path as clients read it: ``/v1/models/{model}``, not Starlette's
    ``{model:path}`` (a parameter that may hold slashes, as model ids do)."""
    return path.replace(":path}", "}")


def openapi_spec(routes: Sequence[ApiRoute], title: str, version: str) -> dict[str, Any]:
    """OpenAPI 3.1: every route, its request model's and its answer's schemas."""
    types = [ErrorResponse, AnthropicError]
    for route in routes:
        types += [*route.body_types, *([route.response] if route.response else [])]
    _, components = msgspec.json.schema_components(types, ref_template=REF_TEMPLATE)
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        path = shown_path(route.path)
        for method in route.methods:
            paths.setdefault(path, {})[method.lower()] = _operation(route, path, method)
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": components},
    }


def _operation(route: ApiRoute, path: str, method: str) -> dict[str, Any]:
    error = AnthropicError if is_anthropic_route(path) else ErrorResponse
    answer: dict[str, Any] = {"description": "OK"}
    if route.response is not None:
        answer["content"] = {"application/json": {"schema": _ref(route.response)}}
    operation: dict[str, Any] = {
        "summary": route.summary,
        "operationId": f"{method.lower()}_{re.sub(r'[^a-z0-9]+', '_', path.lower()).strip('_')}",
        "responses": {
            "200": answer,
            "default": {
                "description": "An error",
                "content": {"application/json": {"schema": _ref(error)}},
            },
        },
    }
    parameters = re.findall(r"{(\w+)}", path)
    if parameters:
        operation["parameters"] = [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
            for name in parameters
        ]
    if route.body is not None and method != "GET":
        refs = [_ref(t) for t in route.body_types]
        schema = refs[0] if len(refs) == 1 else {"oneOf": refs}
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": schema}},
        }
    return operation


def _ref(model: Any) -> dict[str, str]:
    return {"$ref": REF_TEMPLATE.format(name=model.__name__)}


def docs_page(spec: dict[str, Any]) -> str:
    """The spec as one HTML page: each route with its summary and body model, then each
    model's fields (name, type, required), models linked by name."""
    schemas = spec["components"]["schemas"]
    rows = []
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            body = operation.get("requestBody", {}).get("content", {}).get("application/json")
            shown = _type(body["schema"]) if body else ""
            rows.append(
                f"<tr><td><code>{method.upper()}</code></td><td><code>{html.escape(path)}</code>"
                f"</td><td>{html.escape(operation['summary'])}</td><td>{shown}</td></tr>"
            )
    models = []
    for name, schema in sorted(schemas.items()):
        required = set(schema.get("required", ()))
        fields = "".join(
            f"<tr><td><code>{html.escape(field)}</code></td><td>{_type(value)}</td>"
            f"<td>{'yes' if field in required else ''}</td></tr>"
            for field, value in schema.get("properties", {}).items()
        )
        models.append(
            f'<h3 id="{name}">{name}</h3><table><tr><th>field</th><th>type</th>'
            f"<th>required</th></tr>{fields}</table>"
        )
    title = html.escape(spec["info"]["title"])
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title><style>"
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}</style></head><body>"
        f"<h1>{title} {html.escape(spec['info']['version'])}</h1>"
        "<p>The whole description: <a href='openapi.json'>openapi.json</a>.</p><h2>Routes</h2>"
        "<table><tr><th>method</th><th>path</th><th>what</th><th>body</th></tr>"
        f"{''.join(rows)}</table><h2>Models</h2>{''.join(models)}</body></html>"
    )


def _type(schema: dict[str, Any]) -> str:
    """A JSON schema as a short type name, models linked."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return f'<a href="#{name}">{name}</a>'
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " | ".join(_type(s) for s in schema[key])
    kind = schema.get("type")
    if kind == "array":
        return f"list[{_type(schema.get('items', {}))}]"
    if kind == "object":
        return "object"
    return html.escape(str(kind or "any"))
