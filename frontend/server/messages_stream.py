"""The events of one streamed Anthropic message, made from a chat's chunks.

Runs in an HTTP frontend process, on its event loop. The order is Anthropic's, the one its
client's stream helper (``client.messages.stream``) accumulates: ``message_start``; per content
block ``content_block_start``, its ``content_block_delta``s (``thinking_delta`` for reasoning
with ``--reasoning-parser``, ``text_delta``, ``input_json_delta`` for a tool's input as the
model writes it) and ``content_block_stop``, one block after the other; then
``message_delta`` (``stop_reason``, ``stop_sequence``, the output tokens) and
``message_stop``. A failure after the start is an ``error`` event, as Anthropic sends one.
"""

from __future__ import annotations

from typing import Any

import msgspec

from conveyor.frontend.server.errors import anthropic_error
from conveyor.frontend.server.messages_models import (
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    InputJsonDelta,
    MessageDelta,
    MessageObject,
    MessageStart,
    MessageStop,
    OutputUsage,
    StopFields,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ToolUseBlock,
)
from conveyor.frontend.server.response_models import ChatDelta
from conveyor.frontend.server.responses_models import named_event


class MessageEvents:
    """Content blocks built from chat deltas, and the events that say so."""

    def __init__(self) -> None:
        self._num_blocks = 0
        self._open: str | None = None  # the open block's type

    def start(self, message: MessageObject) -> bytes:
        return _event(MessageStart(message))

    def chat_delta(self, delta: ChatDelta) -> list[bytes]:
        events = []
        if delta.reasoning:
            events += self._delta("thinking", ThinkingDelta(delta.reasoning))
        if delta.content:
            events += self._delta("text", TextDelta(delta.content))
        for call in delta.tool_calls or ():
            function = call.function
            if call.id is not None or (function is not None and function.name is not None):
                events += self._close()
                name = function.name if function is not None and function.name else ""
                block = ToolUseBlock(id=call.id or "", name=name, input={})
                events += self._open_block("tool_use", block)
            if function is not None and function.arguments and self._open == "tool_use":
                events += self._delta("tool_use", InputJsonDelta(function.arguments))
        return events

    def end(self, stop_reason: str, stop_sequence: str | None, output_tokens: int) -> bytes:
        """The events that close the last block (an empty text one if there was none, as the
        whole message has) and the message."""
        events = self._close()
        if not self._num_blocks:
            events += self._open_block("text", TextBlock(text=""))
            events += self._close()
        usage = OutputUsage(output_tokens)
        events.append(_event(MessageDelta(StopFields(stop_reason, stop_sequence), usage)))
        events.append(_event(MessageStop()))
        return b"".join(events)

    def error(self, status: int, message: str) -> bytes:
        return _event(anthropic_error(status, message), "error")

    def _delta(self, kind: str, delta: Any) -> list[bytes]:
        events = []
        if self._open != kind:
            events += self._close()
            empty = {"thinking": ThinkingBlock(thinking=""), "text": TextBlock(text="")}
            events += self._open_block(kind, empty[kind])
        events.append(_event(ContentBlockDelta(self._num_blocks - 1, delta)))
        return events

    def _open_block(self, kind: str, block: Any) -> list[bytes]:
        self._open = kind
        self._num_blocks += 1
        return [_event(ContentBlockStart(self._num_blocks - 1, block))]

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        return [_event(ContentBlockStop(self._num_blocks - 1))]


def _event(body: msgspec.Struct, name: str | None = None) -> bytes:
    return named_event(name or type(body).__struct_config__.tag, body)
