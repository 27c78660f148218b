"""A choice's text as it grows, split into content deltas and tool-call deltas.

Runs in the frontend process. Each time the text grows the parser scans it again, and what is
new since the last scan goes out: content that can no longer be the start of a call, a call's
index, id and name once the whole name is written, then its arguments in fragments as the
model writes them (vLLM's delta shape). Nothing goes out while a call's name or arguments are
only partly readable, so a stream never carries empty deltas for a call in progress.

When the choice ends, the whole text is scanned once more (``done``): the calls the whole
response would report get the rest of their arguments, so a stream's fragments join to exactly
the whole response's arguments; a call cut off by max_tokens keeps what it had streamed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from conveyor.frontend.parsers.tool_calls.base import CallDraft, ToolCallParser, new_call_id

logger = logging.getLogger(__name__)


@dataclass
class CallDelta:
    """One piece of one call: its header (id and name) or a fragment of its arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


class ToolCallStream:
    """One choice's content and calls, delta by delta."""

    def __init__(self, parser: ToolCallParser, max_calls: int | None = None) -> None:
        """``max_calls``: the calls kept (1 without parallel calls)."""
        self._parser = parser
        self._max_calls = max_calls
        self._content_sent = ""
        self._ids: list[str] = []  # per call whose header went out
        self._arguments_sent: list[str] = []

    @property
    def num_calls(self) -> int:
        return len(self._ids)

    def feed(self, text: str, done: bool) -> tuple[str, list[CallDelta]]:
        """The content and call pieces to send now, given the whole ``text`` so far."""
        scan = self._parser.scan(text, done)
        content = ""
        if self.num_calls == 0 or not done:
            content = self._new_content(scan.content or "")
        drafts = scan.calls[: self._max_calls]
        deltas: list[CallDelta] = []
        for index, draft in enumerate(drafts):
            if index > len(self._ids) or draft.name is None:
                break  # a call's header goes out only after the one before it
            if done and not draft.complete and index >= len(self._ids):
                break
            deltas += self._call_pieces(index, draft)
        return content, deltas

    def _new_content(self, content: str) -> str:
        if not content.startswith(self._content_sent):
            if content:  # never retract what went out; a parser bug if it happens
                logger.debug("content no longer extends what was sent; holding it")
            return ""
        new = content[len(self._content_sent) :]
        self._content_sent = content
        return new

    def _call_pieces(self, index: int, draft: CallDraft) -> list[CallDelta]:
        pieces = []
        if index == len(self._ids):
            self._ids.append(draft.id or new_call_id())
            self._arguments_sent.append("")
            pieces.append(CallDelta(index, self._ids[index], draft.name))
        sent = self._arguments_sent[index]
        if len(draft.arguments) > len(sent) and draft.arguments.startswith(sent):
            pieces.append(CallDelta(index, arguments=draft.arguments[len(sent) :]))
            self._arguments_sent[index] = draft.arguments
        elif not draft.arguments.startswith(sent):
            logger.debug("call %d's arguments no longer extend what was sent", index)
        return pieces
