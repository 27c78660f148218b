"""Tool calling: tool calls out of a model's text, whole or while it streams.

Runs in the frontend process. Two ways a chat with ``tools`` gets its calls:

* ``tool_choice: "auto"``: the model writes calls in its own format, which the parser chosen
  with ``--tool-call-parser`` reads: ``hermes`` (Hermes, Qwen 2.5/3: ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>``, text before the first call is content) or ``llama3_json``
  (Llama 3.x: the whole output is ``{"name": ..., "parameters": {...}}``, several separated by
  ``;``, after an optional ``<|python_tag|>``). Text that does not parse stays content.
* ``tool_choice: "required"`` or a named function: the output is forced by a JSON schema
  (structured outputs), so it always parses and its arguments always match the function's
  parameters: a list of ``{"name", "parameters"}`` objects (one, unless parallel calls are
  allowed) for ``required``, the arguments object itself for a named function (vLLM's way).

``ToolCallStream`` turns a choice's growing text into content deltas and tool-call deltas: content
goes out as soon as it cannot be the start of a call; a call goes out, whole (id, name and its
arguments), when its end is seen.

The text is the model's, so it is anything a grammar lets through, nesting included (a regex may
force a call whose arguments nest a thousand arrays deep): whatever does not read as a call,
JSON deeper than Python's parser follows included, stays content, never an error.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


def _json_value(text: str) -> Any:
    """``json.loads``, with JSON nested deeper than the parser can follow as one more
    ``ValueError`` (it raises ``RecursionError`` there)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _json_text(value: Any) -> str | None:
    """``value`` as JSON text, or None where it nests too deeply to write."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except RecursionError:
        return None


@dataclass
class ToolCall:
    name: str
    # The arguments as JSON text, as OpenAI's API carries them.
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


class ToolCallParser(ABC):
    """One model family's tool-call format."""

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output; no call: the text is all content."""

    @abstractmethod
    def content_end(self, text: str) -> int:
        """How much of a growing text is certainly content (nothing after it can make it a
        call): what a stream may send now."""


def _call_of(value: Any, arguments_key: str = "arguments") -> ToolCall | None:
    """A ``{"name": ..., "arguments": {...}}`` object as a call, or None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(arguments, str):
        try:
            arguments = _json_value(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    text = _json_text(arguments)
    return None if text is None else ToolCall(value["name"], text)


class HermesParser(ToolCallParser):
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        first = text.find(self.START)
        if first < 0:
            return text, []
        calls, position = [], first
        while (start := text.find(self.START, position)) >= 0:
            end = text.find(self.END, start)
            if end < 0:
                break
            try:
                call = _call_of(_json_value(text[start + len(self.START) : end]))
            except ValueError:
                call = None
            if call is None:
                return text, []  # not a well-formed call: the model was writing prose
            calls.append(call)
            position = end + len(self.END)
        if not calls:
            return text, []
        content = text[:first]
        return (content if content.strip() else None), calls

    def content_end(self, text: str) -> int:
        start = text.find(self.START)
        if start >= 0:
            return start
        # Hold back an end that may be the start of "<tool_call>".
        for keep in range(min(len(self.START) - 1, len(text)), 0, -1):
            if self.START.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)


class Llama3JsonParser(ToolCallParser):
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :].strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        position = 0
        while position < len(body):
            try:
                value, position = decoder.raw_decode(body, position)
            except (ValueError, RecursionError):
                return text, []
            call = _call_of(value, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            while position < len(body) and body[position] in " \n\t;":
                position += 1
        return None, calls

    def content_end(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or stripped[0] == "{" or self.TAG.startswith(stripped[: len(self.TAG)]):
            return 0  # may be a call: wait for the whole output
        return len(text)


PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def forced_schema(tools: list[dict[str, Any]], named: str | None, parallel: bool) -> dict:
    """The JSON schema an output must follow when a call is required (``named``: that one)."""
    if named is not None:
        for tool in tools:
            if tool["function"]["name"] == named:
                return _parameters(tool)
        raise ValueError(f"tool_choice names {named!r}, which is not among the tools")
    one_of = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool["function"]["name"]},
                "parameters": _parameters(tool),
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


def forced_calls(text: str, named: str | None) -> list[ToolCall]:
    """The calls of an output forced by ``forced_schema`` (it parses: the grammar saw to it,
    unless the output was cut at max_tokens)."""
    try:
        value = _json_value(text)
    except ValueError:
        return []
    if named is not None:
        arguments = _json_text(value) if isinstance(value, dict) else None
        return [] if arguments is None else [ToolCall(named, arguments)]
    calls = [_call_of(item, "parameters") for item in value] if isinstance(value, list) else []
    return [call for call in calls if call is not None]


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


class ToolCallStream:
    """One choice's deltas split into content and tool calls, as the text grows."""

    def __init__(
        self, parser: ToolCallParser | None, forced: str | None | bool, max_calls: int | None = None
    ) -> None:
        """``parser`` for ``auto``; ``forced``: False for auto, else the named function (or
        None for ``required``); ``max_calls``: the calls kept (1 without parallel calls)."""
        self._parser = parser
        self._forced = forced
        self._max_calls = max_calls
        self._text = ""
        self._content_sent = 0
        self._calls_sent = 0

    def feed(self, delta: str, done: bool) -> tuple[str, list[ToolCall]]:
        """The content that may go out now and the calls completed, after ``delta``."""
        self._text += delta
        if self._forced is not False:
            if not done:
                return "", []
            named = self._forced if isinstance(self._forced, str) else None
            forced = forced_calls(self._text, named)
            # Cut at max_tokens, it is no call: the text goes out as content, as when whole.
            return self._content_to(0 if forced else len(self._text)), self._new(forced)
        assert self._parser is not None
        if done:
            content, calls = self._parser.parse(self._text)
            content_end = len(content) if calls and content is not None else 0
            if not calls:
                content_end = len(self._text)
            return self._content_to(content_end), self._new(calls)
        end = self._parser.content_end(self._text)
        complete = self._parser.parse(self._text)[1] if end < len(self._text) else []
        return self._content_to(end), self._new(complete)

    @property
    def num_calls(self) -> int:
        return self._calls_sent

    def _content_to(self, end: int) -> str:
        if end <= self._content_sent:
            return ""
        out = self._text[self._content_sent : end]
        self._content_sent = end
        return out

    def _new(self, calls: list[ToolCall]) -> list[ToolCall]:
        calls = calls[: self._max_calls]
        new = calls[self._calls_sent :]
        self._calls_sent = max(self._calls_sent, len(calls))
        return new
