"""JSON text as a model writes it: where a value ends, which keys an object holds, all on
text that may still be growing.

Runs in the frontend process. Tool-call parsers stream a call's arguments as the model writes
them, so they need the extent of a JSON value in a text that may stop anywhere: ``value_end``
says where a value ends, or that it has not ended yet. The scan jumps over strings with a
regular expression (C speed), so a call whose arguments hold kilobytes of text costs
microseconds per look, however often a stream looks again.

Whatever the model wrote is accepted as input: text that is not JSON gives "not a value"
(``BROKEN``), never an exception.
"""

from __future__ import annotations

import json
import re
from typing import Any

# What ``value_end`` says of a value that can never be completed by more text.
BROKEN = -1
# A string (the "unrolled loop" form: runs of plain characters matched at once).
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_STRING_OPEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*\\?\Z', re.DOTALL)
_STRUCTURE = re.compile(r'[{}\[\]"]')
_SCALAR = re.compile(r"-?[0-9][0-9eE.+\-]*|true|false|null")
_SPACE = re.compile(r"[ \t\r\n]*")
_SCALAR_PREFIXES = ("true", "false", "null")


def skip_space(text: str, position: int) -> int:
    return _SPACE.match(text, position).end()  # type: ignore[union-attr]


def value_end(text: str, start: int, done: bool = False) -> int | None:
    """The end of the JSON value at ``start`` (after optional whitespace): an index, None while
    the text may still complete it, or ``BROKEN``. ``done``: no more text will come, so a
    number at the very end is whole."""
    position = skip_space(text, start)
    if position >= len(text):
        return None
    first = text[position]
    if first == '"':
        match = _STRING.match(text, position)
        if match is not None:
            return match.end()
        return None if _STRING_OPEN.match(text, position) else BROKEN
    if first in "{[":
        return _container_end(text, position)
    match = _SCALAR.match(text, position)
    if match is None:
        rest = text[position:]
        return None if any(p.startswith(rest) for p in _SCALAR_PREFIXES) else BROKEN
    if match.end() == len(text) and not done:
        return None  # more digits, or the rest of a literal, may follow
    return match.end()


def _container_end(text: str, position: int) -> int | None:
    """The end of the object or array at ``position``, counting brackets outside strings (the
    text between them is checked when the value is decoded)."""
    depth = 0
    while True:
        match = _STRUCTURE.search(text, position)
        if match is None:
            return None
        char = match.group()
        if char == '"':
            string = _STRING.match(text, match.start())
            if string is None:
                return None if _STRING_OPEN.match(text, match.start()) else BROKEN
            position = string.end()
            continue
        depth += 1 if char in "{[" else -1
        position = match.end()
        if depth == 0:
            return position


def decode(text: str) -> Any:
    """``json.loads`` with JSON nested deeper than Python's parser follows as one more
    ``ValueError`` (it raises ``RecursionError`` there)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def encode(value: Any) -> str | None:
    """``value`` as JSON text (non-ASCII kept, as vLLM writes it), or None where it is no JSON
    value (bytes, infinity) or nests too deeply to write."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (RecursionError, TypeError, ValueError):
        return None


def object_members(text: str, start: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The members of the object at ``start`` read so far: key -> (value start, value end or
    None while it grows), and the object's end (None while open, ``BROKEN`` if it is not an
    object). A key is listed once its whole string and colon are read."""
    members: dict[str, tuple[int, int | None]] = {}
    position = skip_space(text, start)
    if position >= len(text):
        return members, None
    if text[position] != "{":
        return members, BROKEN
    position = skip_space(text, position + 1)
    if text.startswith("}", position):
        return members, position + 1
    while position < len(text):
        key_match = _STRING.match(text, position)
        if key_match is None:
            open_key = text[position] == '"' and _STRING_OPEN.match(text, position)
            return members, None if open_key else BROKEN
        try:
            key = json.loads(key_match.group())
        except ValueError:
            return members, BROKEN
        position = skip_space(text, key_match.end())
        if position >= len(text):
            return members, None
        if text[position] != ":":
            return members, BROKEN
        value_start = skip_space(text, position + 1)
        end = value_end(text, value_start)
        if end == BROKEN:
            return members, BROKEN
        members[key] = (value_start, end)
        if end is None:
            return members, None
        position = skip_space(text, end)
        if position >= len(text):
            return members, None
        if text[position] == "}":
            return members, position + 1
        if text[position] != ",":
            return members, BROKEN
        position = skip_space(text, position + 1)
    return members, None


def partial_overlap(text: str, marker: str) -> int:
    """How many of ``text``'s last characters are a proper start of ``marker``: what a stream
    holds back, since the next characters may complete the marker."""
    for keep in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:keep]):
            return keep
    return 0
