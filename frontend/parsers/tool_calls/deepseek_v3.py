"""deepseek_v3 and deepseek_v31: DeepSeek-V3/R1 and DeepSeek-V3.1's calls
(``--tool-call-parser deepseek_v3`` / ``deepseek_v31``)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1 writes ``<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>``.
Content is the text before ``<｜tool▁calls▁begin｜>``.
"""

from __future__ import annotations

from conveyor.frontend.parsers.tool_calls.base import (
    CallDraft,
    Scan,
    ToolCallParser,
    json_arguments,
    tagged_calls,
)

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE = "```json"


class DeepSeekV3Parser(ToolCallParser):
    needs_special_tokens = True

    def scan(self, text: str, done: bool) -> Scan:
        return tagged_calls(text, done, CALLS_BEGIN, CALL_BEGIN, CALL_END, self.call)

    def call(self, call_text: str, closed: bool) -> CallDraft | None:
        """``function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```."""
        sep = call_text.find(SEP)
        if sep < 0:
            return None
        fence = call_text.find(FENCE, sep)
        if fence < 0:
            return None  # the name is whole only when the fence starts
        name = call_text[sep + len(SEP) : fence].strip()
        body = call_text[fence + len(FENCE) :]
        closing = body.rfind("```")
        if closing >= 0:
            body = body[:closing]
        arguments, complete = json_arguments(body, 0, closed)
        return CallDraft(name, arguments, closed and complete)


class DeepSeekV31Parser(DeepSeekV3Parser):
    def call(self, call_text: str, closed: bool) -> CallDraft | None:
        """``NAME<｜tool▁sep｜>ARGS``."""
        sep = call_text.find(SEP)
        if sep < 0:
            return None
        arguments, complete = json_arguments(call_text, sep + len(SEP), closed)
        return CallDraft(call_text[:sep].strip(), arguments, closed and complete)
