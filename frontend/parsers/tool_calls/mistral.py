"""mistral: Mistral's calls after ``[TOOL_CALLS]`` (``--tool-call-parser mistral``), in either of
its tokenizers' formats:

* v11 and later: ``[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]get_time{...}`` (Hugging
  Face tokenizers may write ``[ARGS]`` between the name and the arguments);
* before v11: ``[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]``.

Content is the text before the first ``[TOOL_CALLS]``; call ids are 9 letters and digits, which
Mistral's templates require of the ids sent back with the results.
"""

from __future__ import annotations

import random
import string

from conveyor.frontend.parsers.tool_calls.base import (
    CallDraft,
    Scan,
    ToolCallParser,
    content_before,
    json_arguments,
    json_call,
    whole,
)
from conveyor.frontend.parsers.tool_calls.json_text import BROKEN, skip_space

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"


def mistral_call_id() -> str:
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


class MistralParser(ToolCallParser):
    needs_special_tokens = True

    def scan(self, text: str, done: bool) -> Scan:
        content, start = content_before(text, MARKER, done)
        if start < 0:
            return Scan(content)
        position = skip_space(text, start + len(MARKER))
        if position >= len(text):
            return Scan(content if not done else text)
        drafts = self._array(text, position, done) if text[position] == "[" else None
        if drafts is None:
            drafts = self._named(text, start, done)
        for draft in drafts:
            draft.id = mistral_call_id() if draft.id is None else draft.id
        return whole(text, drafts, content) if done else Scan(content, drafts)

    def _named(self, text: str, start: int, done: bool) -> list[CallDraft]:
        drafts = []
        pieces = text[start:].split(MARKER)[1:]
        for i, piece in enumerate(pieces):
            brace = piece.find("{")
            if brace < 0:
                continue  # the name is whole only when the arguments start
            closed = i < len(pieces) - 1 or done
            name = piece[:brace].replace(ARGS, "").strip()
            arguments, complete = json_arguments(piece, brace, closed)
            drafts.append(CallDraft(name, arguments, closed and complete))
        return drafts

    def _array(self, text: str, position: int, done: bool) -> list[CallDraft]:
        drafts = []
        position = skip_space(text, position + 1)
        while position < len(text) and text[position] == "{":
            draft, end = json_call(text, position, done)
            if end == BROKEN:
                break
            drafts.append(draft)
            if end is None:
                break
            position = skip_space(text, end)
            if not text.startswith(",", position):
                break
            position = skip_space(text, position + 1)
        return drafts
