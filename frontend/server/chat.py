"""POST /v1/chat/completions: messages through the model's chat template, n choices out.

Runs in an HTTP frontend process, on its event loop. The conversation is rendered with the
tokenizer's own template (``add_generation_prompt=True``) and tokenized here, so every frontend
process spends its own CPU on it. In a stream, a choice's first chunk carries its ``role``: it
goes out with the choice's first output, so a request that fails before the engine produced
anything gets an error event, not the start of a message.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from starlette.responses import Response
from starlette.types import Receive

from conveyor.frontend.input_processor import Choice
from conveyor.frontend.output_processor import ChoiceDelta, LogprobRow
from conveyor.frontend.server.chat_tools import (
    ChatTools,
    call_deltas,
    calls_out,
    chat_tools,
    message_dict,
)
from conveyor.frontend.server.logprobs import chat_logprobs
from conveyor.frontend.server.request_models import (
    ChatCompletionRequest,
    ChatMessage,
    chat_max_tokens,
    chat_num_logprobs,
    message_text,
    structured_param,
    to_sampling_params,
)
from conveyor.frontend.server.response_models import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    ChatStreamChoice,
    UsageInfo,
    sse_event,
)
from conveyor.frontend.server.serving import (
    GenerationRun,
    ServingState,
    as_bad_request,
    check_model,
    check_prompts,
    ended_normally,
    make_choices,
    prepare_size,
)
from conveyor.protocol import SamplingParams

ROLE = "assistant"
# A short chat (a message or two of a few words) is prepared on the event loop; see
# ``LOOP_PREPARE_LIMIT``.
TEMPLATE_CHARS_PER_MESSAGE = 128


async def create_chat_completion(
    state: ServingState, body: ChatCompletionRequest, receive: Receive
) -> Response:
    arrival_time = time.monotonic()
    check_model(state, body.model)
    num_logprobs = chat_num_logprobs(body)
    defaults = state.inputs.sampling_defaults
    max_tokens = chat_max_tokens(body, defaults)
    truncating = body.truncate_prompt_tokens is not None
    tools = chat_tools(body, state.inputs.tool_call_parser)
    conversation, size = conversation_of(state, body.messages, truncating)
    vocab_size = state.config.model.vocab_size
    params = to_sampling_params(body, max_tokens, num_logprobs, vocab_size, defaults)
    if tools.schema is not None:
        params = msgspec.structs.replace(params, structured_outputs=tools.structured_outputs())
    prompt, response_id, choices = await state.run_cpu_unless_small(
        prepare_size(size, params),
        _prepare,
        state,
        body,
        conversation,
        max_tokens,
        params,
        arrival_time,
        tools,
    )
    run = _ChatRun(state, body, [prompt], response_id, choices, num_logprobs, tools)
    return await run.respond(receive)


def conversation_of(
    state: ServingState, messages: list[ChatMessage], truncating: bool = False
) -> tuple[list[dict[str, Any]], int]:
    """The messages as the chat template takes them, after the checks that cost a ``len``
    (only the body's size bounds a chat that will be truncated), and the size of preparing them
    (see ``LOOP_PREPARE_LIMIT``)."""
    with as_bad_request():
        state.inputs.check_conversation_size(len(messages), 0)
    conversation = [message_dict(m, message_text(m, i)) for i, m in enumerate(messages)]
    num_chars = sum(len(m["content"]) for m in conversation)
    if not truncating:
        with as_bad_request():
            state.inputs.check_conversation_size(len(conversation), num_chars)
    # The template costs about as much per message as tokenizing this many characters.
    return conversation, num_chars + TEMPLATE_CHARS_PER_MESSAGE * len(conversation)


def _prepare(
    state: ServingState,
    body: ChatCompletionRequest,
    conversation: list[dict[str, Any]],
    max_tokens: int | None,
    params: SamplingParams,
    arrival_time: float,
    tools: ChatTools,
) -> tuple[list[int], str, list[Choice]]:
    """The chat template, tokenizing, checks and fan-out: on the CPU pool unless small."""
    with as_bad_request():
        prompt = state.inputs.render_chat(
            conversation,
            add_generation_prompt=body.add_generation_prompt,
            template_kwargs=body.chat_template_kwargs,
            tools=tools.tools,
        )
        prompt = state.inputs.truncate(prompt, body.truncate_prompt_tokens)
    check_prompts(state, [prompt], max_tokens)
    response_id, choices = make_choices(
        state, [prompt], params, body.priority, arrival_time, bool(body.stream),
        "tools" if tools.schema is not None else structured_param(body),
    )  # fmt: skip
    return prompt, f"chatcmpl-{response_id}", choices


class _ChatRun(GenerationRun):
    """One chat request in flight: messages out, the role with each choice's first chunk."""

    def __init__(
        self,
        state: ServingState,
        body: ChatCompletionRequest,
        prompts: list[list[int]],
        response_id: str,
        choices: list[Choice],
        num_logprobs: int | None,
        tools: ChatTools,
    ) -> None:
        super().__init__(state, body, prompts, response_id, choices)
        self.num_logprobs = num_logprobs
        self._started: set[int] = set()  # choices whose role went out
        self._tools = tools
        self._tool_streams = (
            {c.state.index: tools.stream() for c in choices} if tools.active else {}
        )

    def response(self) -> ChatCompletionResponse:
        choices = []
        for c in self.states:
            message, finish_reason = ChatMessageOut(ROLE, c.text), c.finish_reason
            if self._tools.active:
                content, calls = self._tools.split(c.text)
                if calls:
                    message = ChatMessageOut(ROLE, content, calls_out(calls))
                    finish_reason = "tool_calls"
            logprobs = self._logprobs(c.logprobs)
            choices.append(ChatChoice(c.index, message, logprobs, finish_reason, c.stop_reason))
        return ChatCompletionResponse(
            self.response_id, self.created, self.state.model_name, choices, self.usage()
        )

    def delta_event(self, delta: ChoiceDelta) -> bytes:
        first = delta.index not in self._started
        self._started.add(delta.index)
        message = ChatDelta(ROLE if first else None, delta.text)
        finish_reason = delta.finish_reason
        stream = self._tool_streams.get(delta.index)
        if stream is not None:
            num_sent = stream.num_calls
            content, calls = stream.feed(delta.text, done=delta.finish_reason is not None)
            message.content = content
            if calls:
                message.tool_calls = call_deltas(calls, num_sent)
            if stream.num_calls and ended_normally(delta):
                finish_reason = "tool_calls"
        choice = ChatStreamChoice(delta.index, message, self._logprobs(delta.logprobs))
        if ended_normally(delta):
            choice.finish_reason, choice.stop_reason = finish_reason, delta.stop_reason
        return self._chunk([choice])

    def usage_event(self) -> bytes:
        return self._chunk([], self.usage())

    def _chunk(self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> bytes:
        chunk = ChatCompletionChunk(self.response_id, self.created, self.state.model_name, choices)
        chunk.usage = usage
        return sse_event(chunk)

    def _logprobs(self, rows: list[LogprobRow]) -> ChatChoiceLogprobs | None:
        if self.num_logprobs is None:
            return None
        return ChatChoiceLogprobs(chat_logprobs(self.state.tokenizer, rows, self.num_logprobs))
