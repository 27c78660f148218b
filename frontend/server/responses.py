"""POST /v1/responses (OpenAI's Responses API), and GET / DELETE / cancel of a stored response.

Runs in an HTTP frontend process, on its event loop. A Responses request is a chat underneath:
``responses_input`` translates it (input items -> messages, options -> chat's fields), chat's
pipeline prepares and runs it (``chat.prepare_chat_run``: the chat template, tools, structured
outputs, the engine requests), and this module translates what comes out: the whole chat
response into a response object, or each chat chunk into Responses' stream events
(``responses_stream``). A response is kept in the server's store (``responses_store``) unless
``store: false``, so GET /v1/responses/{id} finds it and ``previous_response_id`` continues its
conversation.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

from starlette.responses import Response
from starlette.types import Receive

from conveyor.frontend.engine_client.session import EngineDeadError
from conveyor.frontend.output_processor import ChoiceDelta
from conveyor.frontend.server.chat import _ChatRun as ChatRun  # chat's run, read-only here
from conveyor.frontend.server.chat import prepare_chat_run
from conveyor.frontend.server.errors import ApiError, bad_request
from conveyor.frontend.server.request_models import ChatMessage, FunctionCallIn, ToolCallIn
from conveyor.frontend.server.response_models import ChatCompletionResponse, encode_json
from conveyor.frontend.server.responses_input import (
    chat_request,
    check_supported,
    renamed,
)
from conveyor.frontend.server.responses_models import (
    DeletedResponse,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningOut,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextConfig,
    TextFormat,
)
from conveyor.frontend.server.responses_store import ResponsesStore, StoredResponse
from conveyor.frontend.server.responses_stream import ResponseEvents
from conveyor.frontend.server.serving import (
    ServingState,
    SSEResponse,
    check_model,
    raise_on_error,
    run_unless_disconnected,
    start_stream,
)
from conveyor.protocol import FAILED_FINISH_REASONS

logger = logging.getLogger(__name__)


async def create_response(
    state: ServingState, store: ResponsesStore, body: ResponsesRequest, receive: Receive
) -> Response:
    check_model(state, body.model)
    check_supported(body)
    keep = body.store is not False
    if body.store and not store.limits.enabled:
        raise bad_request("store: this server keeps no responses (--responses-store-size 0)")
    history: list[ChatMessage] = []
    if body.previous_response_id is not None:
        history = await _previous_messages(state, store, body.previous_response_id)
    chat_body = chat_request(body, history)
    try:
        chat_run = await prepare_chat_run(state, chat_body)
    except ApiError as exc:
        raise renamed(exc) from None
    num_instructions = 1 if body.instructions else 0
    run = ResponsesRun(state, body, chat_run, store if keep and store.limits.enabled else None)
    run.conversation = chat_body.messages[num_instructions:]
    return await run.respond(receive)


async def _previous_messages(
    state: ServingState, store: ResponsesStore, response_id: str
) -> list[ChatMessage]:
    if not store.limits.enabled:
        raise bad_request(
            "previous_response_id: this server keeps no responses (--responses-store-size 0)",
            "previous_response_id",
        )
    stored = await state.run_cpu(store.get, response_id)
    if stored is None:
        raise ApiError(
            404, f"no stored response {response_id!r} (expired, or never stored)",
            "previous_response_id",
        )  # fmt: skip
    return stored.messages


class ResponsesRun:
    """One Responses request in flight: a chat run, seen as a response."""

    def __init__(
        self,
        state: ServingState,
        body: ResponsesRequest,
        chat_run: ChatRun,
        store: ResponsesStore | None,
    ) -> None:
        self.state = state
        self.body = body
        self.chat_run = chat_run
        self.store = store
        # A fresh id, or the client's request_id (vLLM's field).
        self.response_id = "resp_" + (body.request_id or uuid.uuid4().hex)
        chat_run.response_id = self.response_id  # what --enable-log-requests lines name
        self.created_at = int(time.time())
        self.conversation: list[ChatMessage] = []

    async def respond(self, receive: Receive) -> Response:
        if self.body.stream:
            deltas = await start_stream(receive, self.chat_run.deltas())
            return SSEResponse(self.events(deltas))
        chat = await run_unless_disconnected(receive, self.chat_run.collect())
        assert isinstance(chat, ChatCompletionResponse)
        response = self.response(_output_items(chat), chat.choices[0].finish_reason)
        await self.keep(response)
        return Response(encode_json(response), media_type="application/json")

    def response(
        self, output: list[OutputItem], finish_reason: str | None, status: str | None = None
    ) -> ResponseObject:
        """The response object: in progress (``finish_reason`` None), or ended."""
        body = self.body
        response = ResponseObject(
            id=self.response_id,
            created_at=self.created_at,
            model=self.state.model_name,
            status=status or ("in_progress" if finish_reason is None else "completed"),
            output=output,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            parallel_tool_calls=body.parallel_tool_calls is not False,
            previous_response_id=body.previous_response_id,
            reasoning=ReasoningOut(body.reasoning.effort if body.reasoning else None),
            store=self.store is not None,
            temperature=body.temperature,
            top_p=body.top_p,
            text=body.text or TextConfig(format=TextFormat(type="text")),
            tool_choice=body.tool_choice or ("auto" if body.tools else "none"),
            tools=body.tools or [],
            user=body.user,
            metadata=body.metadata or {},
        )
        if finish_reason == "length":
            response.status = "incomplete"
            response.incomplete_details = IncompleteDetails("max_output_tokens")
        if finish_reason is not None:
            usage = self.chat_run.usage()
            cached = sum(s.num_cached_tokens for s in self.chat_run.states)
            details = usage.completion_tokens_details
            reasoning = details.reasoning_tokens if details else 0
            response.usage = ResponseUsage(
                usage.prompt_tokens,
                usage.completion_tokens,
                usage.total_tokens,
                InputTokensDetails(cached),
                OutputTokensDetails(reasoning),
            )
        return response

    async def keep(self, response: ResponseObject) -> None:
        """Store the ended response with its conversation (for GET and previous_response_id)."""
        if self.store is None:
            return
        messages = [*self.conversation, *_as_messages(response.output)]
        await self.state.run_cpu(self.store.put, StoredResponse(response, messages))

    async def events(self, source: AsyncIterator[ChoiceDelta]) -> AsyncIterator[bytes]:
        """Responses' stream: created, in_progress, the output items' events as the chat's
        chunks come, then completed (or an error event and failed)."""
        events = ResponseEvents()
        yield events.created(self.response([], None))
        finish_reason = None
        try:
            async with contextlib.aclosing(source) as deltas:  # type: ignore[type-var]
                async for delta in deltas:
                    if delta.finish_reason in FAILED_FINISH_REASONS:
                        continue  # reported below, as the whole response's error
                    chunk = self.chat_run.stream_chunk(delta)
                    if chunk is None:
                        continue  # held back (a marker's first characters, say)
                    choice = chunk.choices[0]
                    for event in events.chat_delta(choice.delta, choice.logprobs):
                        yield event
                    finish_reason = choice.finish_reason or finish_reason
            raise_on_error(self.chat_run.states)
        except Exception as exc:
            yield events.failed(self.response(events.items(), None, "failed"), *_error_of(exc))
            return
        for event in events.close():
            yield event
        response = self.response(events.items(), finish_reason or "stop")
        await self.keep(response)
        yield events.completed(response)


def _error_of(exc: Exception) -> tuple[str, str]:
    """(code, message) of a failed stream, as a whole response's error would say it."""
    if isinstance(exc, ApiError):
        return str(exc.status), exc.message
    if isinstance(exc, EngineDeadError):
        return "503", f"the engine failed: {exc}"
    logger.exception("unexpected error streaming a response", exc_info=exc)
    return "500", f"internal error: {type(exc).__name__}"


def _output_items(chat: ChatCompletionResponse) -> list[OutputItem]:
    """A whole chat response's message as output items: its reasoning (with a reasoning
    parser), its text (unless it is only calls), its calls."""
    message = chat.choices[0].message
    items: list[OutputItem] = []
    if message.reasoning:
        text = ReasoningText(text=message.reasoning)
        items.append(ReasoningItem(id=f"rs_{uuid.uuid4().hex}", content=[text], status="completed"))
    if message.content or not message.tool_calls:
        logprobs = chat.choices[0].logprobs
        text = OutputText(
            text=message.content or "",
            logprobs=list(logprobs.content or []) if logprobs is not None else [],
        )
        items.append(
            OutputMessage(id=f"msg_{uuid.uuid4().hex}", status="completed", content=[text])
        )
    for call in message.tool_calls or ():
        items.append(
            FunctionCallItem(
                id=f"fc_{uuid.uuid4().hex}",
                call_id=call.id,
                name=call.function.name,
                arguments=call.function.arguments,
                status="completed",
            )
        )
    return items


def _as_messages(output: list[OutputItem]) -> list[ChatMessage]:
    """A response's output as the assistant message a later request's history holds."""
    text = "".join(
        part.text for item in output if isinstance(item, OutputMessage) for part in item.content
    )
    reasoning = "".join(
        part.text for item in output if isinstance(item, ReasoningItem) for part in item.content
    )
    calls = [
        ToolCallIn(item.call_id, FunctionCallIn(item.name, item.arguments))
        for item in output
        if isinstance(item, FunctionCallItem)
    ]
    message = ChatMessage("assistant", text, tool_calls=calls or None)
    message.reasoning = reasoning or None
    return [message]


# ---------------------------------------------------------------- the stored responses


async def get_response(state: ServingState, store: ResponsesStore, response_id: str) -> Response:
    stored = await state.run_cpu(store.get, response_id)
    if stored is None:
        raise ApiError(404, f"no stored response {response_id!r} (expired, or never stored)")
    return Response(encode_json(stored.response), media_type="application/json")


async def delete_response(state: ServingState, store: ResponsesStore, response_id: str) -> Response:
    if not await state.run_cpu(store.delete, response_id):
        raise ApiError(404, f"no stored response {response_id!r} (expired, or never stored)")
    return Response(encode_json(DeletedResponse(response_id)), media_type="application/json")


async def cancel_response(state: ServingState, store: ResponsesStore, response_id: str) -> Response:
    if await state.run_cpu(store.get, response_id) is None:
        raise ApiError(404, f"no stored response {response_id!r} (expired, or never stored)")
    raise bad_request(
        "only a background response can be cancelled, and this server runs none in the "
        "background (background: true is refused); a stream is cancelled by closing it"
    )
