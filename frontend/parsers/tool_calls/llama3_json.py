"""llama3_json: Llama 3.1-3.3 and Llama 4's JSON calls (``--tool-call-parser llama3_json``,
also ``llama4_json``).

The whole output is calls: an optional ``<|python_tag|>``, then JSON objects
``{"name": ..., "parameters": {...}}`` (or ``"arguments"``) separated by ``;``. An output that
does not start so is content, whole; one whose objects are not all calls is content too. A last
object cut off at the end is left out.
"""

from __future__ import annotations

from conveyor.frontend.parsers.tool_calls.base import CallDraft, Scan, ToolCallParser, json_call
from conveyor.frontend.parsers.tool_calls.json_text import BROKEN, skip_space

TAG = "<|python_tag|>"


class Llama3JsonParser(ToolCallParser):
    needs_special_tokens = True  # <|python_tag|>

    def scan(self, text: str, done: bool) -> Scan:
        position = skip_space(text, 0)
        if text.startswith(TAG, position):
            position = skip_space(text, position + len(TAG))
        elif TAG.startswith(text[position:]) and not done:
            return Scan("")  # may be the tag
        if position >= len(text):
            return Scan(text if done else "")
        if text[position] != "{":
            return Scan(text)  # prose: content, whole and streamed
        drafts: list[CallDraft] = []
        while position < len(text):
            draft, end = json_call(text, position, done, ("parameters", "arguments"))
            if end == BROKEN or (end is not None and not draft.complete):
                return Scan(text) if done else Scan("", drafts)
            drafts.append(draft)
            if end is None:
                break
            position = skip_space(text, end)
            if text.startswith(";", position):
                position = skip_space(text, position + 1)
            elif position < len(text):
                return Scan(text) if done else Scan("", drafts)
        if not done:
            return Scan("", drafts)
        calls = [draft for draft in drafts if draft.complete]
        return Scan(None, calls) if calls else Scan(text)
