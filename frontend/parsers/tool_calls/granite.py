"""granite: IBM Granite 3.0-3.3's calls (``--tool-call-parser granite``): the whole answer is
``<|tool_call|>`` (or ``<tool_call>``) and a JSON array of ``{"name", "arguments"}`` objects.
An answer that does not start so is content.
"""

from __future__ import annotations

from conveyor.frontend.parsers.tool_calls.base import CallDraft, Scan, ToolCallParser, json_call
from conveyor.frontend.parsers.tool_calls.json_text import BROKEN, skip_space

TAGS = ("<|tool_call|>", "<tool_call>")


class GraniteParser(ToolCallParser):
    needs_special_tokens = True

    def scan(self, text: str, done: bool) -> Scan:
        position = skip_space(text, 0)
        rest = text[position:]
        tag = next((t for t in TAGS if rest.startswith(t)), None)
        if tag is None:
            if not done and any(t.startswith(rest) for t in TAGS):
                return Scan("")
            if not rest.startswith("["):
                return Scan(text)
        else:
            position = skip_space(text, position + len(tag))
        if position >= len(text):
            return Scan(text if done else "")
        if text[position] != "[":
            return Scan(text)
        drafts: list[CallDraft] = []
        position = skip_space(text, position + 1)
        while position < len(text) and text[position] == "{":
            draft, end = json_call(text, position, done)
            if end == BROKEN:
                return Scan(text) if done else Scan("", drafts)
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
