"""What every tool-call format shares: a call, a call still being written, and the parser's one
job, ``scan``.

Runs in the frontend process. A parser reads the text a model wrote (whole, or so far in a
stream) and says which part is content and which calls it holds. ``scan(text, done)`` is the
whole contract:

* ``done=False`` (a stream): ``content`` is the text that is certainly content (nothing later
  can make it part of a call), and ``calls`` are the calls begun so far, each with its name once
  the whole name is written and its arguments' JSON text so far. What a scan reports must only
  grow: a later scan's content and each call's arguments start with this one's, so a stream can
  send the difference.
* ``done=True`` (the whole output): ``content`` is the message's content (None when empty and
  there are calls) and ``calls`` the well-formed calls. A call cut off at the end (max_tokens)
  is left out and the whole ones before it are kept; text that does not read as calls at all
  stays content, never an error.

A call's arguments are JSON text: as the model wrote it where the format is JSON (so the
streamed fragments join to exactly the arguments of the whole response), else built from what
the model wrote (XML parameters, Python keyword arguments), as vLLM's parsers do.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from conveyor.frontend.parsers.tool_calls.json_text import (
    BROKEN,
    decode,
    object_members,
    partial_overlap,
    skip_space,
    value_end,
)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    # The arguments as JSON text, as OpenAI's API carries them.
    arguments: str
    id: str = field(default_factory=new_call_id)


@dataclass
class CallDraft:
    """A call as far as it is written."""

    name: str | None = None  # None until the whole name is read
    arguments: str = ""  # the arguments' JSON text so far
    complete: bool = False  # its end was seen and it is well formed
    id: str | None = None  # where the format carries one (Kimi K2's functions.NAME:IDX)

    def call(self) -> ToolCall:
        assert self.name is not None
        return ToolCall(self.name, self.arguments, self.id or new_call_id())


@dataclass
class Scan:
    content: str | None
    calls: list[CallDraft] = field(default_factory=list)


class ToolCallParser(ABC):
    """One model family's tool-call format."""

    # The tokens of the format are special tokens in the family's tokenizer: the text must be
    # decoded with them (vLLM's parsers set skip_special_tokens false the same way).
    needs_special_tokens = False
    # The parser reads the model's raw output rather than the content a reasoning parser left
    # (gpt-oss: the calls are messages on a channel of their own).
    reads_raw_output = False

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        """``tools``: the request's function definitions (formats that write arguments as text
        convert them to JSON by each parameter's type)."""
        self.tools = tools or []

    def parameter_type(self, function: str, parameter: str) -> str | None:
        """The JSON type a function's parameter declares, or None."""
        for tool in self.tools:
            if tool.get("function", {}).get("name") == function:
                spec = (tool["function"].get("parameters") or {}).get("properties", {})
                declared = spec.get(parameter, {}).get("type")
                return declared if isinstance(declared, str) else None
        return None

    @abstractmethod
    def scan(self, text: str, done: bool) -> Scan:
        """See the module docstring."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output."""
        scan = self.scan(text, done=True)
        return scan.content, [draft.call() for draft in scan.calls if draft.complete]


def whole(text: str, drafts: list[CallDraft], content: str) -> Scan:
    """A whole output's scan: its complete calls, else all of it is content."""
    calls = [draft for draft in drafts if draft.complete]
    if not calls:
        return Scan(text)
    return Scan(content if content.strip() else None, calls)


_NAME_KEYS = ("name",)
_ARGUMENT_KEYS = ("arguments", "parameters")


def json_call(
    text: str, start: int, done: bool, argument_keys: tuple[str, ...] = _ARGUMENT_KEYS
) -> tuple[CallDraft, int | None]:
    """The ``{"name": ..., "arguments": {...}}`` object at ``start`` as a call draft, and the
    object's end (None while open, ``BROKEN`` if it is no such object). The draft is complete
    when the object is, its name a string and its arguments an object."""
    members, end = object_members(text, start)
    draft = CallDraft()
    name = members.get("name")
    if name is not None and name[1] is not None:
        value = _decoded(text[name[0] : name[1]])
        if not isinstance(value, str):
            return draft, BROKEN
        draft.name = value
    key = next((k for k in argument_keys if k in members), None)
    if key is not None:
        value_start, value_end = members[key]
        raw = text[value_start : len(text) if value_end is None else value_end]
        if raw.startswith('"'):
            # Arguments written as a JSON string holding JSON: sent once decoded.
            decoded = _decoded(raw) if value_end is not None else None
            draft.arguments = decoded if isinstance(decoded, str) else ""
        else:
            draft.arguments = raw if value_end is not None else raw.rstrip()
    if end is None or end == BROKEN:
        return draft, end
    draft.complete = draft.name is not None and _is_object_text(draft.arguments or "{}")
    if key is None and draft.complete:
        draft.arguments = "{}"
    return draft, end


def _decoded(text: str) -> object:
    try:
        return decode(text)
    except ValueError:
        return None


def _is_object_text(text: str) -> bool:
    try:
        return isinstance(decode(text), dict)
    except ValueError:
        return False


def is_object_text(text: str) -> bool:
    """``text`` is a JSON object (what a call's arguments must be)."""
    return _is_object_text(text)


def text_value(text: str, declared: str | None) -> Any:
    """A parameter written as text (XML formats) as the JSON value its declared type says:
    strings stay text, anything else is read as JSON where it reads (vLLM's conversion)."""
    if declared == "string":
        return text
    try:
        return decode(text)
    except ValueError:
        return text


def tagged_region(text: str, start: str, end: str, position: int) -> tuple[int, int, int] | None:
    """The next ``start``...``end`` region from ``position``: (where start begins, where its body
    begins, where end begins or -1 while open), or None if there is no ``start``."""
    found = text.find(start, position)
    if found < 0:
        return None
    body = found + len(start)
    return found, body, text.find(end, body)


def tagged_calls(
    text: str,
    done: bool,
    section: str,
    begin: str,
    end: str,
    call: Callable[[str, bool], CallDraft | None],
) -> Scan:
    """The scan of a format whose calls follow the content from ``section`` on, each between
    ``begin`` and ``end``: ``call(its text so far, closed)`` reads one (None while it cannot yet
    say the call's name, which ends the scan there)."""
    content, start = content_before(text, section, done)
    if start < 0:
        return Scan(content)
    drafts: list[CallDraft] = []
    position = start
    while (region := tagged_region(text, begin, end, position)) is not None:
        _, body, stop = region
        draft = call(text[body : stop if stop >= 0 else len(text)], stop >= 0 or done)
        if draft is None:
            break
        drafts.append(draft)
        if stop < 0:
            break
        position = stop + len(end)
    return whole(text, drafts, content) if done else Scan(content, drafts)


def json_arguments(text: str, start: int, closed: bool) -> tuple[str, bool]:
    """The JSON object written from ``start`` as a call's arguments: its text so far and
    whether it is whole (an object that parses). ``closed``: the call's end marker follows,
    so nothing more will come."""
    position = skip_space(text, start)
    end = value_end(text, position, done=closed)
    if end is None:
        return ("" if closed else text[position:].rstrip()), False
    if end == BROKEN:
        return "", False
    arguments = text[position:end]
    return arguments, _is_object_text(arguments)


def content_before(text: str, marker: str, done: bool) -> tuple[str, int]:
    """The content before the first ``marker`` and where the marker is (-1: none yet, the
    content holding back what may be its start)."""
    found = text.find(marker)
    if found >= 0:
        return text[:found], found
    return (text if done else text[: len(text) - partial_overlap(text, marker)]), -1
