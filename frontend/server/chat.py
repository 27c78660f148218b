"""POST /v1/chat/completions: messages through the model's chat template, n choices out.

Runs in an HTTP frontend process, on its event loop. The conversation is rendered with the
tokenizer's own template (``add_generation_prompt=True``) and tokenized here, so every frontend
process spends its own CPU on it. In a stream, a choice's first chunk carries its ``role``: it
goes out with the choice's first output, so a request that fails before the engine produced
anything gets an error event, not the start of a message.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from starlette.responses import Response
from starlette.types import Receive

from frontend.input_processor import Choice
from frontend.output_processor import ChoiceDelta, LogprobRow
from frontend.server.choice_stream import stream_choices
from frontend.server.errors import ApiError, error_body
from frontend.server.logprobs import chat_logprobs
from frontend.server.request_models import (
    ChatCompletionRequest,
    chat_max_tokens,
    chat_num_logprobs,
    message_text,
    to_sampling_params,
)
from frontend.server.response_models import (
    SSE_DONE,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    ChatStreamChoice,
    encode_json,
    sse_event,
)
from frontend.server.serving import (
    ServingState,
    SSEResponse,
    as_bad_request,
    check_model,
    check_prompts,
    make_choices,
    raise_on_error,
    run_unless_disconnected,
    start_stream,
    usage,
)
from protocol import FAILED_FINISH_REASONS

ROLE = "assistant"


async def create_chat_completion(
    state: ServingState, body: ChatCompletionRequest, receive: Receive
) -> Response:
    arrival_time = time.monotonic()
    check_model(state, body.model)
    num_logprobs = chat_num_logprobs(body)
    max_tokens = chat_max_tokens(body)
    prompt = render_chat(state, body)
    check_prompts(state, [prompt], max_tokens)
    params = to_sampling_params(body, max_tokens, num_logprobs, state.config.model.vocab_size)
    response_id, choices = make_choices(
        state, [prompt], params, body.priority, arrival_time, bool(body.stream)
    )
    run = _ChatRun(state, body, prompt, f"chatcmpl-{response_id}", choices, num_logprobs)
    if body.stream:
        return SSEResponse(run.events(await start_stream(receive, run.deltas())))
    response = await run_unless_disconnected(receive, run.collect())
    return Response(encode_json(response), media_type="application/json")


def render_chat(state: ServingState, body: ChatCompletionRequest) -> list[int]:
    """The conversation as prompt token ids, through the model's chat template."""
    conversation = [
        {"role": m.role, "content": message_text(m, i)} for i, m in enumerate(body.messages)
    ]
    with as_bad_request():
        return state.inputs.render_chat(conversation)


class _ChatRun:
    """One chat request in flight."""

    def __init__(
        self,
        state: ServingState,
        body: ChatCompletionRequest,
        prompt: list[int],
        response_id: str,
        choices: list[Choice],
        num_logprobs: int | None,
    ) -> None:
        self.state = state
        self.body = body
        self.prompt = prompt
        self.response_id = response_id
        self.choices = choices
        self.states = [choice.state for choice in choices]
        self.num_logprobs = num_logprobs
        self.created = int(time.time())

    def deltas(self) -> AsyncIterator[ChoiceDelta]:
        return stream_choices(self.state.client, self.choices, self.state.metrics)

    def _logprobs(self, rows: list[LogprobRow]) -> ChatChoiceLogprobs | None:
        if self.num_logprobs is None:
            return None
        return ChatChoiceLogprobs(chat_logprobs(self.state.tokenizer, rows, self.num_logprobs))

    async def collect(self) -> ChatCompletionResponse:
        async with contextlib.aclosing(self.deltas()) as deltas:
            async for _ in deltas:
                pass
        raise_on_error(self.states)
        choices = [
            ChatChoice(
                t.index,
                ChatMessageOut(ROLE, t.text),
                self._logprobs(t.logprobs),
                t.finish_reason,
                t.stop_reason,
            )
            for t in self.states
        ]
        return ChatCompletionResponse(
            self.response_id,
            self.created,
            self.state.model_name,
            choices,
            usage([self.prompt], self.states),
        )

    def _chunk(self, choices: list[ChatStreamChoice], with_usage: bool = False) -> bytes:
        chunk = ChatCompletionChunk(self.response_id, self.created, self.state.model_name, choices)
        if with_usage:
            chunk.usage = usage([self.prompt], self.states)
        return sse_event(chunk)

    async def events(self, source: AsyncIterator[ChoiceDelta]) -> AsyncIterator[bytes]:
        started: set[int] = set()  # choices whose role went out
        try:
            async with contextlib.aclosing(source) as deltas:  # type: ignore[type-var]
                async for delta in deltas:
                    # A failed choice sends nothing itself: the error event below reports it.
                    ended = delta.finish_reason not in (None, *FAILED_FINISH_REASONS)
                    if delta.text or delta.logprobs or ended:
                        first = delta.index not in started
                        started.add(delta.index)
                        yield self._chunk([self._stream_choice(delta, first)])
            raise_on_error(self.states)
        except ApiError as exc:
            yield sse_event(error_body(exc.status, exc.message))
        except Exception as exc:  # EngineDeadError above all: the stream ends with an error event
            yield sse_event(error_body(503, f"the engine failed: {exc}"))
        else:
            options = self.body.stream_options
            if options is not None and options.include_usage:
                yield self._chunk([], with_usage=True)
        yield SSE_DONE

    def _stream_choice(self, delta: ChoiceDelta, first: bool) -> ChatStreamChoice:
        message = ChatDelta(ROLE if first else None, delta.text)
        choice = ChatStreamChoice(delta.index, message, self._logprobs(delta.logprobs))
        if delta.finish_reason is not None and delta.finish_reason not in FAILED_FINISH_REASONS:
            choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
        return choice
