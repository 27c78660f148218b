"""pythonic: calls as a Python list, Llama 3.2 and Llama 4's format (``--tool-call-parser
pythonic``, also ``llama4_pythonic``)::

    [get_weather(city="Paris", unit="C"), get_time(zone="CET")]

Llama 4 may wrap the list in ``<|python_start|>`` ... ``<|python_end|>``. The whole answer is the
list or it is content; keyword values are Python literals, the arguments their JSON (as vLLM
converts them). A stream sends a call, name and arguments, once its ``)`` closes: a call whose
values do not convert (bytes, infinity) is dropped and its siblings kept, as in vLLM.
"""

from __future__ import annotations

import ast

from conveyor.frontend.parsers.tool_calls.base import CallDraft, Scan, ToolCallParser
from conveyor.frontend.parsers.tool_calls.json_text import encode

START, END = "<|python_start|>", "<|python_end|>"


class PythonicParser(ToolCallParser):
    needs_special_tokens = True

    def scan(self, text: str, done: bool) -> Scan:
        body = text.strip()
        if body.startswith(START):
            body = body[len(START) :].strip()
        elif not done and START.startswith(body):
            return Scan("")
        if body.endswith(END):
            body = body[: -len(END)].strip()
        if not body.startswith("["):
            if not done and not body:
                return Scan("")
            return Scan(text)
        drafts = [self._call(piece, closed) for piece, closed in _calls(body[1:])]
        if not done:  # a call goes out once it is whole: a sibling may not convert
            return Scan("", [d for d in drafts if d is not None and d.complete])
        # A call that does not convert (bytes, infinity) is dropped, its siblings kept (vLLM's).
        calls = [d for d in drafts if d is not None and d.complete]
        if not calls or not body.endswith("]"):
            return Scan(text)
        return Scan(None, calls)

    def _call(self, piece: str, closed: bool) -> CallDraft | None:
        paren = piece.find("(")
        if paren < 0:
            return None
        name = piece[:paren].strip()
        if not name.isidentifier():
            return None
        if not closed:
            return CallDraft(name)
        try:
            call = ast.parse(piece.strip(), mode="eval").body
            if not isinstance(call, ast.Call) or call.args:
                return CallDraft(name)
            values = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return CallDraft(name)
        if None in values:
            return CallDraft(name)
        arguments = encode(values)
        return CallDraft(name, arguments or "", arguments is not None)


def _calls(text: str) -> list[tuple[str, bool]]:
    """The calls of a list's inside as written so far: (text, whether its ``)`` closed), cut at
    the top level's commas, outside strings and brackets."""
    calls, depth, quote, start, i = [], 0, "", 0, 0
    while i < len(text):
        char = text[i]
        if quote:
            if char == "\\":
                i += 1
            elif char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth < 0:  # the list's own "]"
                break
            if depth == 0 and char == ")":
                calls.append((text[start : i + 1], True))
                start = i + 1
        elif char == "," and depth == 0:
            start = i + 1
        i += 1
    rest = text[start:i].strip()
    if rest and depth > 0:
        calls.append((rest, False))
    return calls
