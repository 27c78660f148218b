"""What every reasoning format shares, and the most common one: reasoning between two markers.

Runs in the frontend process. A parser is made per request, from the chat template's
variables (``enable_thinking``, ``thinking``) and the prompt the template wrote, since both
decide whether the answer starts inside the reasoning, or after it (a template that turned
thinking off writes an empty ``<think></think>`` into the prompt itself).

``split(text, done)`` is the whole contract, like a tool-call parser's ``scan``: the reasoning
and the content of the text so far. In a stream (``done`` false) both only grow, so the
difference can go out: a marker's first characters are held back until the next ones show
whether it is one. ``done`` gives the whole response's split.

``grammar_prefix`` is what a constraint (structured outputs, a forced tool call) lets through
before it applies: the reasoning, up to and including its end marker, as llguidance's Lark.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from conveyor.frontend.parsers.tool_calls.json_text import partial_overlap


class ReasoningParser(ABC):
    # Its markers are special tokens in the family's tokenizer (gpt-oss's channels).
    needs_special_tokens = False

    def __init__(self, template_kwargs: dict[str, Any] | None, prompt_text: str) -> None:
        self.template_kwargs = template_kwargs or {}
        # The prompt closed the reasoning already (or there is none): the output is all
        # content, and a constraint applies from its first token.
        self.ended_in_prompt = self.reasoning_ended(prompt_text)

    @abstractmethod
    def reasoning_ended(self, prompt_text: str) -> bool:
        """Whether the prompt leaves the model past its reasoning."""

    @abstractmethod
    def split(self, text: str, done: bool) -> tuple[str, str]:
        """(reasoning, content) of the text so far."""

    @abstractmethod
    def grammar_prefix(self, tokenizer: Any) -> str:
        """Lark rules defining ``reasoning``: what comes before the constrained answer."""

    def spans(self, text: str) -> list[tuple[int, int]]:
        """Where a whole output's reasoning lies in it (to count its tokens)."""
        reasoning = self.split(text, done=True)[0]
        start = text.find(reasoning) if reasoning else -1
        return [] if start < 0 else [(start, start + len(reasoning))]

    @classmethod
    def history_fields(cls, reasoning: str) -> dict[str, str]:
        """An earlier assistant turn's reasoning, as the family's template reads it (vLLM passes
        both names)."""
        return {"reasoning": reasoning, "reasoning_content": reasoning}


class ThinkTagsParser(ReasoningParser):
    """Reasoning between ``START`` and ``END`` markers (``<think>``...``</think>``)."""

    START = "<think>"
    END = "</think>"
    # Without a START marker the output begins inside the reasoning (the template opened it,
    # or the model skips it); else the output is content until a START.
    opens_in_reasoning = True
    # Text before START is content (Mistral), else dropped (vLLM's DeepSeek R1 and Qwen3).
    keeps_text_before_start = False

    def reasoning_ended(self, prompt_text: str) -> bool:
        tail = prompt_text.rstrip()
        return tail.endswith(self.END) and tail.rfind(self.END) > tail.rfind(self.START)

    def split(self, text: str, done: bool) -> tuple[str, str]:
        if self.ended_in_prompt:
            return "", text
        before, body = self._after_start(text, done)
        if body is None:
            return "", before
        end = text.find(self.END, body)
        if end >= 0:
            return text[body:end], before + text[end + len(self.END) :]
        keep = 0 if done else partial_overlap(text, self.END)
        return text[body : max(body, len(text) - keep)], before

    def _after_start(self, text: str, done: bool) -> tuple[str, int | None]:
        """The content before the reasoning, and where the reasoning starts (None: not yet, or
        never)."""
        if self.opens_in_reasoning:
            start = len(text) - len(text.lstrip())
            if text.startswith(self.START, start):
                return "", start + len(self.START)
            if not done and self.START.startswith(text[start:]):
                return "", None  # may be the START marker
            return "", 0
        found = text.find(self.START)
        if found >= 0:
            before = text[:found] if self.keeps_text_before_start else ""
            return before, found + len(self.START)
        keep = 0 if done else partial_overlap(text, self.START)
        return text[: len(text) - keep], None

    def grammar_prefix(self, tokenizer: Any) -> str:
        return reasoning_until(tokenizer, self.END)


def reasoning_until(tokenizer: Any, marker: str) -> str:
    """Lark rules: any text, then ``marker`` (by its token where it is one special token,
    which no text lexeme can match)."""
    token_id = special_token_id(tokenizer, marker)
    if token_id is not None:
        return f"reasoning: REASONING_TEXT <[{token_id}]>\nREASONING_TEXT: /(?s:.*)/\n"
    return f"reasoning[lazy]: /(?s:.*){_regex_literal(marker)}/\n"


def special_token_id(tokenizer: Any, text: str) -> int | None:
    """The id of the special token whose text is ``text``, or None."""
    special = getattr(tokenizer, "all_special_tokens", None) or []
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for token_id, token in added.items():
        if str(token) == text and (getattr(token, "special", False) or text in special):
            return int(token_id)
    return None


_REGEX_SPECIAL = set("\\.+*?()|[]{}^$/#&~-")


def _regex_literal(text: str) -> str:
    """``text`` inside a Lark ``/.../`` regex (``/`` escaped too; ``<`` and ``>`` never: a
    backslash makes them word boundaries there)."""
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)
