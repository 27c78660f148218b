"""A choice's text split into reasoning, content and tool calls: whole, or delta by delta.

Runs in the frontend process. The reasoning parser (``--reasoning-parser``) takes the reasoning
out first; the tool-call parser reads what is left (or the raw output, for a format whose calls
live beside the reasoning, gpt-oss's); both only ever report more as the text grows, so a
stream sends differences, and the last delta (``done``) brings a stream to exactly the whole
response's split.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.frontend.parsers.reasoning.base import ReasoningParser
from conveyor.frontend.parsers.tool_calls.base import ToolCall, ToolCallParser
from conveyor.frontend.parsers.tool_calls.stream import CallDelta, ToolCallStream


@dataclass
class SplitOutput:
    """A whole output: None where a part is empty (content: also where there are calls)."""

    reasoning: str | None
    content: str | None
    calls: list[ToolCall] = field(default_factory=list)


@dataclass
class SplitDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


def split_output(
    text: str,
    reasoning: ReasoningParser | None,
    tools: ToolCallParser | None,
    max_calls: int | None = None,
) -> SplitOutput:
    thought, content = reasoning.split(text, done=True) if reasoning is not None else ("", text)
    if tools is None:
        empty_is_none = reasoning is not None
        return SplitOutput(thought or None, (content or None) if empty_is_none else content)
    scan = tools.scan(text if tools.reads_raw_output else content, done=True)
    calls = [draft.call() for draft in scan.calls if draft.complete][:max_calls]
    return SplitOutput(thought or None, scan.content, calls)


class ChoiceSplit:
    """One streamed choice's reasoning, content and calls."""

    def __init__(
        self,
        reasoning: ReasoningParser | None,
        tools: ToolCallParser | None,
        max_calls: int | None = None,
    ) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._calls = ToolCallStream(tools, max_calls) if tools is not None else None
        self._text = ""
        self._reasoning_sent = ""
        self._content_sent = ""

    @property
    def num_calls(self) -> int:
        return 0 if self._calls is None else self._calls.num_calls

    def feed(self, delta: str, done: bool) -> SplitDelta:
        self._text += delta
        if self._reasoning is None:
            thought, content = "", self._text
        else:
            thought, content = self._reasoning.split(self._text, done)
        out = SplitDelta(reasoning=_grown(self._reasoning_sent, thought))
        self._reasoning_sent += out.reasoning
        if self._calls is None:
            out.content = _grown(self._content_sent, content)
            self._content_sent += out.content
            return out
        assert self._tools is not None
        source = self._text if self._tools.reads_raw_output else content
        out.content, out.calls = self._calls.feed(source, done)
        return out


def _grown(sent: str, now: str) -> str:
    """What ``now`` adds to ``sent`` (nothing if it does not extend it: never retract)."""
    return now[len(sent) :] if now.startswith(sent) else ""
