"""The events of one streamed response, made from a chat's chunks.

Runs in an HTTP frontend process, on its event loop. The order is the one OpenAI's stream helper
(``client.responses.stream``) accepts: ``response.created`` and ``response.in_progress`` first;
then per output item ``response.output_item.added``, its content (for a message:
``response.content_part.added``, ``response.output_text.delta``s, ``response.output_text.done``,
``response.content_part.done``; for reasoning (with ``--reasoning-parser``) the same with
``response.reasoning_text.delta``s and ``.done``; for a function call:
``response.function_call_arguments.delta``s and ``.done``) and ``response.output_item.done``, one item after the other; last
``response.completed`` with the whole response (its status ``incomplete`` when
``max_output_tokens`` cut it, as vLLM ends such a stream), or an ``error`` event and
``response.failed``. Every event carries its ``sequence_number``, counted from 0.
"""

from __future__ import annotations

import uuid
from typing import Any

from conveyor.frontend.server.response_models import ChatChoiceLogprobs, ChatDelta
from conveyor.frontend.server.responses_models import (
    ArgumentsDelta,
    ArgumentsDone,
    ContentPartAdded,
    ContentPartDone,
    ErrorEvent,
    FunctionCallItem,
    OutputItem,
    OutputItemAdded,
    OutputItemDone,
    OutputMessage,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    ReasoningItem,
    ReasoningText,
    ReasoningTextDelta,
    ReasoningTextDone,
    ResponseCompleted,
    ResponseCreated,
    ResponseError,
    ResponseFailed,
    ResponseInProgress,
    ResponseObject,
    named_event,
)


class ResponseEvents:
    """Output items built from chat deltas, and the events that say so."""

    def __init__(self) -> None:
        self._sequence = 0
        self._items: list[OutputItem] = []
        self._open: OutputItem | None = None
        # Logprob entries of tokens whose text has not gone out yet (held back by the stream).
        self._pending_logprobs: list[Any] = []

    def created(self, response: ResponseObject) -> bytes:
        return self._event(ResponseCreated(response=response)) + self._event(
            ResponseInProgress(response=response)
        )

    def completed(self, response: ResponseObject) -> bytes:
        return self._event(ResponseCompleted(response=response))

    def failed(self, response: ResponseObject, code: str, message: str) -> bytes:
        error = ErrorEvent(code=code, message=message)
        response.error = ResponseError(code, message)
        return self._event(error) + self._event(ResponseFailed(response=response))

    def items(self) -> list[OutputItem]:
        return list(self._items)

    def chat_delta(self, delta: ChatDelta, logprobs: ChatChoiceLogprobs | None) -> list[bytes]:
        """The events of one chat delta: its text, then the tool calls it starts or extends."""
        events = []
        if logprobs is not None and logprobs.content:
            self._pending_logprobs += logprobs.content
        if delta.reasoning:
            events += self._reasoning(delta.reasoning)
        if delta.content:
            events += self._text(delta.content)
        for call in delta.tool_calls or ():
            function = call.function
            arguments = function.arguments if function is not None else None
            if call.id is not None or (function is not None and function.name is not None):
                events += self._start_call(call.id, function.name if function else None)
            if arguments and isinstance(self._open, FunctionCallItem):
                self._open.arguments += arguments
                item_id, index = self._open.id, len(self._items) - 1
                events.append(self._event(ArgumentsDelta(item_id=item_id, output_index=index,
                                                         delta=arguments)))  # fmt: skip
        return events

    def close(self) -> list[bytes]:
        """The events that end the item still open (the stream has ended)."""
        item, self._open, index = self._open, None, len(self._items) - 1
        if isinstance(item, OutputMessage):
            part = item.content[0]
            part.logprobs += self._pending_logprobs
            self._pending_logprobs = []
            item.status = "completed"
            return [
                self._event(OutputTextDone(item_id=item.id, output_index=index, content_index=0,
                                           text=part.text, logprobs=part.logprobs)),
                self._event(ContentPartDone(item_id=item.id, output_index=index,
                                            content_index=0, part=part)),
                self._event(OutputItemDone(output_index=index, item=item)),
            ]  # fmt: skip
        if isinstance(item, ReasoningItem):
            part = item.content[0]
            item.status = "completed"
            return [
                self._event(ReasoningTextDone(item_id=item.id, output_index=index,
                                              content_index=0, text=part.text)),
                self._event(ContentPartDone(item_id=item.id, output_index=index,
                                            content_index=0, part=part)),
                self._event(OutputItemDone(output_index=index, item=item)),
            ]  # fmt: skip
        if isinstance(item, FunctionCallItem):
            item.status = "completed"
            done = ArgumentsDone(
                item_id=item.id, output_index=index, name=item.name, arguments=item.arguments
            )
            return [self._event(done), self._event(OutputItemDone(output_index=index, item=item))]
        return []

    def _text(self, text: str) -> list[bytes]:
        events = []
        if not isinstance(self._open, OutputMessage):
            events += self.close()
            item = OutputMessage(id=f"msg_{uuid.uuid4().hex}", status="in_progress", content=[])
            events += self._add(item)
            index = len(self._items) - 1
            events.append(self._event(ContentPartAdded(item_id=item.id, output_index=index,
                                                       content_index=0, part=OutputText(text=""))))  # fmt: skip
            item.content.append(OutputText(text=""))
        message = self._open
        assert isinstance(message, OutputMessage)
        part = message.content[0]
        part.text += text
        logprobs, self._pending_logprobs = self._pending_logprobs, []
        part.logprobs += logprobs
        delta = OutputTextDelta(item_id=message.id, output_index=len(self._items) - 1,
                                content_index=0, delta=text, logprobs=logprobs)  # fmt: skip
        return [*events, self._event(delta)]

    def _reasoning(self, text: str) -> list[bytes]:
        events = []
        if not isinstance(self._open, ReasoningItem):
            events += self.close()
            item = ReasoningItem(id=f"rs_{uuid.uuid4().hex}", content=[], status="in_progress")
            events += self._add(item)
            part = ReasoningText(text="")
            events.append(self._event(ContentPartAdded(item_id=item.id, output_index=len(self._items) - 1,
                                                       content_index=0, part=part)))  # fmt: skip
            item.content.append(ReasoningText(text=""))
        item = self._open
        assert isinstance(item, ReasoningItem)
        item.content[0].text += text
        delta = ReasoningTextDelta(item_id=item.id, output_index=len(self._items) - 1,
                                   content_index=0, delta=text)  # fmt: skip
        return [*events, self._event(delta)]

    def _start_call(self, call_id: str | None, name: str | None) -> list[bytes]:
        events = self.close()
        item = FunctionCallItem(
            id=f"fc_{uuid.uuid4().hex}",
            call_id=call_id or f"call_{uuid.uuid4().hex[:24]}",
            name=name or "",
            arguments="",
            status="in_progress",
        )
        return [*events, *self._add(item)]

    def _add(self, item: OutputItem) -> list[bytes]:
        self._items.append(item)
        self._open = item
        return [self._event(OutputItemAdded(output_index=len(self._items) - 1, item=item))]

    def _event(self, event: Any) -> bytes:
        event.sequence_number = self._sequence
        self._sequence += 1
        return named_event(type(event).__struct_config__.tag, event)
