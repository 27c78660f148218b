"""granite: IBM Granite 3.2/3.3 (``--reasoning-parser granite``).

Granite thinks when asked (``chat_template_kwargs`` ``thinking: true``) and writes its two parts
after plain-text headers: ``Here is my thought process:`` (or ``Here's``) and ``Here is my
response:``. An output that does not open with the first header is all content.

Where vLLM reads a whole output that opened its thought process but never reached the response
header as all content, while its stream sent that text as reasoning, here both say reasoning.
"""

from __future__ import annotations

import re
from typing import Any

from conveyor.frontend.parsers.reasoning.base import ReasoningParser
from conveyor.frontend.parsers.tool_calls.json_text import partial_overlap

THOUGHT = ("Here is my thought process:", "Here's my thought process:")
RESPONSE = ("Here is my response:", "Here's my response:")
_RESPONSE = re.compile("|".join(re.escape(marker) for marker in RESPONSE))


class GraniteParser(ReasoningParser):
    def reasoning_ended(self, prompt_text: str) -> bool:
        return not self.template_kwargs.get("thinking")

    def split(self, text: str, done: bool) -> tuple[str, str]:
        if self.ended_in_prompt:
            return "", text
        start = len(text) - len(text.lstrip())
        opening = next((m for m in THOUGHT if text.startswith(m, start)), None)
        if opening is None:
            if not done and any(m.startswith(text[start:]) for m in THOUGHT):
                return "", ""  # may be the header
            return "", text
        body = start + len(opening)
        response = _RESPONSE.search(text, body)
        if response is not None:
            return text[body : response.start()], text[response.end() :]
        keep = 0 if done else max(partial_overlap(text, m) for m in RESPONSE)
        return text[body : max(body, len(text) - keep)], ""

    def grammar_prefix(self, tokenizer: Any) -> str:
        return "reasoning[lazy]: /(?s:.*)Here('s| is) my response:/\n"
