"""Calls forced by a grammar: ``tool_choice: "required"`` and a named function.

Runs in the frontend process. The output is constrained by a JSON schema (structured outputs),
so it parses and its arguments match the function's parameters whatever the model: a JSON
array of ``{"name", "parameters"}`` objects (one, unless parallel calls are allowed) for
``required``, the arguments object itself for a named function (vLLM's way). The formats do not
depend on the model's own, so every ``--tool-call-parser`` (or none) serves them.

Both are read like any other format (``scan``), so they stream the same way: a call's name,
then its arguments as they are written. An output cut at max_tokens keeps the calls it finished.
"""

from __future__ import annotations

from typing import Any

from conveyor.frontend.parsers.tool_calls.base import (
    CallDraft,
    Scan,
    ToolCallParser,
    is_object_text,
    json_call,
)
from conveyor.frontend.parsers.tool_calls.json_text import BROKEN, skip_space, value_end

_ARGUMENT_KEYS = ("parameters", "arguments")


def forced_schema(tools: list[dict[str, Any]], named: str | None, parallel: bool) -> dict:
    """The JSON schema an output must follow when a call is required (``named``: that one)."""
    if named is not None:
        for tool in tools:
            if tool["function"]["name"] == named:
                return parameters_of(tool)
        raise ValueError(f"tool_choice names {named!r}, which is not among the tools")
    one_of = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool["function"]["name"]},
                "parameters": parameters_of(tool),
            },  # fmt: skip
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": one_of}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parameters_of(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


class RequiredCallsParser(ToolCallParser):
    """``[{"name": ..., "parameters": {...}}, ...]``."""

    def scan(self, text: str, done: bool) -> Scan:
        drafts: list[CallDraft] = []
        position = skip_space(text, 0)
        if text.startswith("[", position):
            position = skip_space(text, position + 1)
            while position < len(text) and text[position] == "{":
                draft, end = json_call(text, position, done, _ARGUMENT_KEYS)
                if end == BROKEN:
                    break
                drafts.append(draft)
                if end is None:
                    break
                position = skip_space(text, end)
                if not text.startswith(",", position):
                    break
                position = skip_space(text, position + 1)
        if not done:
            return Scan("", drafts)
        calls = [draft for draft in drafts if draft.complete]
        return Scan(None, calls) if calls else Scan(text)


class NamedCallParser(ToolCallParser):
    """The named function's arguments object."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def scan(self, text: str, done: bool) -> Scan:
        start = skip_space(text, 0)
        if start >= len(text):
            return Scan(text if done else "")
        end = value_end(text, start)
        if end is None or end == BROKEN:
            if done:
                return Scan(text)
            return Scan("", [] if end == BROKEN else [CallDraft(self.name, text[start:].rstrip())])
        draft = CallDraft(self.name, text[start:end])
        draft.complete = is_object_text(draft.arguments)
        if done and not draft.complete:
            return Scan(text)
        return Scan(None if done else "", [draft])
