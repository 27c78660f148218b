"""kimi_k2: Kimi K2's calls (``--tool-call-parser kimi_k2``)::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

The call's id is what the model wrote (``functions.get_weather:0``), as vLLM returns it; the
name is the part between the dot and the colon. Content is the text before the section.
"""

from __future__ import annotations

from conveyor.frontend.parsers.tool_calls.base import (
    CallDraft,
    Scan,
    ToolCallParser,
    json_arguments,
    tagged_calls,
)

SECTION = "<|tool_calls_section_begin|>"
BEGIN, ARGUMENTS, END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


class KimiK2Parser(ToolCallParser):
    needs_special_tokens = True

    def scan(self, text: str, done: bool) -> Scan:
        return tagged_calls(text, done, SECTION, BEGIN, END, self._call)

    def _call(self, call_text: str, closed: bool) -> CallDraft | None:
        marker = call_text.find(ARGUMENTS)
        if marker < 0:
            return None
        call_id = call_text[:marker].strip()
        name = call_id.split(":")[0].split(".")[-1]
        arguments, complete = json_arguments(call_text, marker + len(ARGUMENTS), closed)
        return CallDraft(name, arguments, closed and complete, call_id)
