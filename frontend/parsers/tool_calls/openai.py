"""openai: gpt-oss's calls, harmony messages to ``functions.NAME`` on the commentary channel
(``--tool-call-parser openai``)::

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

The message's body is the call's arguments. Content is the final channel's text; the analysis
channel is the reasoning parser's (``--reasoning-parser openai_gptoss``), so this parser reads
the raw output (``frontend/parsers/harmony.py``).
"""

from __future__ import annotations

from conveyor.frontend.parsers import harmony
from conveyor.frontend.parsers.tool_calls.base import (
    CallDraft,
    Scan,
    ToolCallParser,
    is_object_text,
)


class OpenAIParser(ToolCallParser):
    needs_special_tokens = True
    reads_raw_output = True

    def scan(self, text: str, done: bool) -> Scan:
        messages = harmony.read_messages(text, done)
        if done and not messages:
            return Scan(text)
        drafts = []
        for message in messages:
            if harmony.is_call(message):
                assert message.recipient is not None
                name = message.recipient.removeprefix("functions.")
                arguments = message.body.strip()
                drafts.append(CallDraft(name, arguments))
                drafts[-1].complete = message.ended and is_object_text(arguments)
        content = harmony.reasoning_and_content(messages)[1]
        if not done:
            return Scan(content, drafts)
        calls = [draft for draft in drafts if draft.complete]
        return Scan(content or None, calls) if calls else Scan(content)
