"""hermes: Hermes 2/3, Qwen 2.5 and Qwen3 (``--tool-call-parser hermes``).

Calls are JSON objects between tags, after optional text::

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Content is the text before the first ``<tool_call>`` (text after the calls is dropped, as
vLLM drops it). A tag whose body is not such an object makes the whole output content (the
model was writing about tags, not calling); a last call cut off before its end is left out.
"""

from __future__ import annotations

from conveyor.frontend.parsers.tool_calls.base import (
    CallDraft,
    Scan,
    ToolCallParser,
    json_call,
    whole,
)
from conveyor.frontend.parsers.tool_calls.json_text import BROKEN, partial_overlap, skip_space

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolCallParser):
    # vLLM's: the tags are special tokens in some of the family's tokenizers.
    needs_special_tokens = True

    def scan(self, text: str, done: bool) -> Scan:
        first = text.find(START)
        if first < 0:
            return Scan(text if done else text[: len(text) - partial_overlap(text, START)])
        drafts: list[CallDraft] = []
        position = first
        while (start := text.find(START, position)) >= 0:
            body = start + len(START)
            close = text.find(END, body)
            body_text = text[: close if close >= 0 else len(text)]
            draft, end = json_call(body_text, body, done or close >= 0)
            broken = end == BROKEN or (close >= 0 and not _only_space_after(body_text, end))
            if broken and (done or close >= 0):
                # Not a call (prose about the tags): the whole output is content.
                return Scan(text) if done else Scan(text[:first], drafts)
            drafts.append(draft)
            if close < 0:
                break
            position = close + len(END)
        if done:
            return whole(text, drafts, text[:first])
        return Scan(text[:first], drafts)


def _only_space_after(text: str, end: int | None) -> bool:
    return end is not None and end != BROKEN and skip_space(text, end) == len(text)
