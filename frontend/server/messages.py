"""POST /v1/messages (Anthropic's Messages API) and POST /v1/messages/count_tokens.

Runs in an HTTP frontend process, on its event loop. A Messages request is a chat underneath:
``messages_input`` translates it, chat's pipeline prepares and runs it
(``chat.prepare_chat_run``), and this module translates what comes out: the whole chat response
into a message (thinking, text and ``tool_use`` blocks; ``stop_reason`` ``end_turn``,
``max_tokens``, ``stop_sequence`` or ``tool_use``), or each chat chunk into Anthropic's stream
events (``messages_stream``). Errors on these routes take Anthropic's shape
(``errors.error_response``); the API key may come as ``x-api-key`` (``gate``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import Response
from starlette.types import Receive

from conveyor.frontend.engine_client.session import EngineDeadError
from conveyor.frontend.output_processor import ChoiceDelta
from conveyor.frontend.server.chat import _ChatRun as ChatRun  # chat's run, read-only here
from conveyor.frontend.server.chat import prepare_chat_run
from conveyor.frontend.server.errors import ApiError
from conveyor.frontend.server.messages_input import chat_request, renamed
from conveyor.frontend.server.messages_models import (
    CountTokensRequest,
    MessageObject,
    MessagesRequest,
    MessageUsage,
    OutputBlock,
    TextBlock,
    ThinkingBlock,
    TokenCount,
    ToolUseBlock,
)
from conveyor.frontend.server.messages_stream import MessageEvents
from conveyor.frontend.server.request_models import ChatCompletionRequest
from conveyor.frontend.server.response_models import ChatChoice, ChatCompletionResponse, encode_json
from conveyor.frontend.server.serving import (
    ServingState,
    SSEResponse,
    raise_on_error,
    run_unless_disconnected,
    start_stream,
)
from conveyor.protocol import FAILED_FINISH_REASONS

logger = logging.getLogger(__name__)


async def create_message(state: ServingState, body: MessagesRequest, receive: Receive) -> Response:
    chat_run = await _prepare(state, chat_request(body))
    return await MessagesRun(state, chat_run).respond(receive, bool(body.stream))


async def count_tokens(state: ServingState, body: CountTokensRequest) -> Response:
    """The prompt's tokens, as messages.create would render it (tools and thinking included):
    chat's preparation, never sent to the engine."""
    chat_body = chat_request(body)
    chat_body.max_tokens = 1  # counting needs room for no answer
    chat_run = await _prepare(state, chat_body)
    count = TokenCount(len(chat_run.prompts[0]))
    return Response(encode_json(count), media_type="application/json")


async def _prepare(state: ServingState, chat_body: ChatCompletionRequest) -> ChatRun:
    try:
        return await prepare_chat_run(state, chat_body)
    except ApiError as exc:
        raise renamed(exc) from None


class MessagesRun:
    """One Messages request in flight: a chat run, seen as an Anthropic message."""

    def __init__(self, state: ServingState, chat_run: ChatRun) -> None:
        self.state = state
        self.chat_run = chat_run
        self.message_id = "msg_" + uuid.uuid4().hex
        chat_run.response_id = self.message_id  # what --enable-log-requests lines name

    async def respond(self, receive: Receive, stream: bool) -> Response:
        if stream:
            return SSEResponse(self.events(await start_stream(receive, self.chat_run.deltas())))
        chat = await run_unless_disconnected(receive, self.chat_run.collect())
        assert isinstance(chat, ChatCompletionResponse)
        choice = chat.choices[0]
        stop_reason, stop_sequence = _stop_reason(choice.finish_reason, choice.stop_reason)
        message = self.message(_blocks(choice), stop_reason, stop_sequence)
        return Response(encode_json(message), media_type="application/json")

    def message(
        self, content: list[OutputBlock], stop_reason: str | None, stop_sequence: str | None
    ) -> MessageObject:
        states = self.chat_run.states
        cached = sum(s.num_cached_tokens for s in states)
        usage = MessageUsage(
            input_tokens=len(self.chat_run.prompts[0]) - cached,
            output_tokens=sum(len(s.token_ids) for s in states),
            cache_read_input_tokens=cached,
        )
        return MessageObject(
            id=self.message_id,
            model=self.state.model_name,
            content=content,
            usage=usage,
            stop_reason=stop_reason,
            stop_sequence=stop_sequence,
        )

    async def events(self, source: AsyncIterator[ChoiceDelta]) -> AsyncIterator[bytes]:
        """message_start with the first output, each chunk's block events, then message_delta
        and message_stop (or an error event)."""
        events = MessageEvents()
        finish: tuple[str | None, int | str | None] = (None, None)
        try:
            async with contextlib.aclosing(source) as deltas:  # type: ignore[type-var]
                started = False
                async for delta in deltas:
                    if not started:
                        started = True
                        yield events.start(self.message([], None, None))
                    if delta.finish_reason in FAILED_FINISH_REASONS:
                        continue  # reported below
                    chunk = self.chat_run.stream_chunk(delta)
                    if chunk is None:
                        continue
                    choice = chunk.choices[0]
                    for event in events.chat_delta(choice.delta):
                        yield event
                    if choice.finish_reason is not None:
                        finish = (choice.finish_reason, choice.stop_reason)
            raise_on_error(self.chat_run.states)
        except Exception as exc:
            yield events.error(*_error_of(exc))
            return
        stop_reason, stop_sequence = _stop_reason(*finish)
        output_tokens = sum(len(s.token_ids) for s in self.chat_run.states)
        yield events.end(stop_reason, stop_sequence, output_tokens)


def _error_of(exc: Exception) -> tuple[int, str]:
    """(status, message) of a failed stream, as a whole response's error would say it."""
    if isinstance(exc, ApiError):
        return exc.status, exc.message
    if isinstance(exc, EngineDeadError):
        return 503, f"the engine failed: {exc}"
    logger.exception("unexpected error streaming a message", exc_info=exc)
    return 500, f"internal error: {type(exc).__name__}"


def _stop_reason(finish_reason: str | None, stop_reason: int | str | None) -> tuple[str, Any]:
    """Anthropic's (stop_reason, stop_sequence) for chat's finish."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _blocks(choice: ChatChoice) -> list[OutputBlock]:
    """A whole chat message as content blocks: thinking, text (unless the message is only
    calls), tool uses."""
    message = choice.message
    blocks: list[OutputBlock] = []
    if message.reasoning:
        blocks.append(ThinkingBlock(thinking=message.reasoning))
    if message.content or not message.tool_calls:
        blocks.append(TextBlock(text=message.content or ""))
    for call in message.tool_calls or ():
        blocks.append(ToolUseBlock(id=call.id, name=call.function.name, input=_input(call)))
    return blocks


def _input(call: Any) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's ``input`` is (every parser reads objects;
    anything else would be no call)."""
    try:
        arguments = json.loads(call.function.arguments)
    except (ValueError, RecursionError):
        return {}
    return arguments if isinstance(arguments, dict) else {}
