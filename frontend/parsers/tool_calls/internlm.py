"""internlm: InternLM2/2.5's calls (``--tool-call-parser internlm``)::

    Let me check.<|action_start|><|plugin|>
    {"name": "get_weather", "parameters": {"city": "Paris"}}<|action_end|>

One call per answer; content is the text before ``<|action_start|>``.
"""

from __future__ import annotations

from conveyor.frontend.parsers.tool_calls.base import (
    Scan,
    ToolCallParser,
    content_before,
    json_call,
    whole,
)
from conveyor.frontend.parsers.tool_calls.json_text import BROKEN, skip_space

START, PLUGIN, END = "<|action_start|>", "<|plugin|>", "<|action_end|>"


class InternLMParser(ToolCallParser):
    needs_special_tokens = True

    def scan(self, text: str, done: bool) -> Scan:
        content, start = content_before(text, START, done)
        if start < 0:
            return Scan(content)
        body = skip_space(text, start + len(START))
        if not text.startswith(PLUGIN, body):
            return Scan(text) if done else Scan(content)
        close = text.find(END, body)
        call_text = text[: close if close >= 0 else len(text)]
        draft, end = json_call(call_text, body + len(PLUGIN), done)
        if end == BROKEN:
            return Scan(text) if done else Scan(content)
        return whole(text, [draft], content) if done else Scan(content, [draft])
