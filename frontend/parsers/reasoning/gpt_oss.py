"""openai_gptoss: gpt-oss's harmony channels (``--reasoning-parser openai_gptoss``, also
``gpt_oss``): the ``analysis`` channel is the reasoning, ``final`` the content
(``frontend/parsers/harmony.py``). Its earlier reasoning goes back into its template as
``thinking``, the name gpt-oss's template reads.
"""

from __future__ import annotations

import re
from typing import Any

from conveyor.frontend.parsers import harmony
from conveyor.frontend.parsers.reasoning.base import (
    ReasoningParser,
    reasoning_until,
    special_token_id,
)

FINAL_HEADER = harmony.CHANNEL + "final" + harmony.MESSAGE
_ANALYSIS = re.compile(
    re.escape(harmony.CHANNEL + "analysis" + harmony.MESSAGE)
    + "(.*?)(?:"
    + "|".join(re.escape(e) for e in harmony.ENDINGS)
    + "|$)",
    re.DOTALL,
)


class GptOssParser(ReasoningParser):
    needs_special_tokens = True

    def reasoning_ended(self, prompt_text: str) -> bool:
        return prompt_text.endswith(FINAL_HEADER)

    def split(self, text: str, done: bool) -> tuple[str, str]:
        if self.ended_in_prompt:
            return "", text
        messages = harmony.read_messages(text, done)
        if done and not messages:
            return "", text  # no harmony at all: the text is the answer
        return harmony.reasoning_and_content(messages)

    def grammar_prefix(self, tokenizer: Any) -> str:
        ids = {}
        for name, marker in (
            ("start", harmony.START),
            ("channel", harmony.CHANNEL),
            ("message", harmony.MESSAGE),
            ("end", harmony.END),
        ):
            ids[name] = special_token_id(tokenizer, marker)
        if None in ids.values():  # a tokenizer without harmony's tokens: the markers are text
            return reasoning_until(tokenizer, FINAL_HEADER)
        return (
            f'reasoning: analysis* <[{ids["channel"]}]> "final" <[{ids["message"]}]>\n'
            f'analysis: <[{ids["channel"]}]> "analysis" <[{ids["message"]}]> HARMONY_TEXT '
            f'<[{ids["end"]}]> <[{ids["start"]}]> "assistant"\n'
            "HARMONY_TEXT: /(?s:.*)/\n"
        )

    def spans(self, text: str) -> list[tuple[int, int]]:
        if self.ended_in_prompt:
            return []
        return [(m.start(1), m.end(1)) for m in _ANALYSIS.finditer(text)]

    @classmethod
    def history_fields(cls, reasoning: str) -> dict[str, str]:
        return {**super().history_fields(reasoning), "thinking": reasoning}
