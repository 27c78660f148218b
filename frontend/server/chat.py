"""POST /v1/chat/completions: messages through the model's chat template, n choices out.

Runs in an HTTP frontend process, on its event loop. The conversation is rendered with the
tokenizer's own template (or ``--chat-template``) and tokenized here, so every frontend process
spends its own CPU on it. In a stream, a choice's first chunk carries its ``role``: it goes out
with the choice's first output, so a request that fails before the engine produced anything gets
an error event, not the start of a message. The role is the assistant's, or, as vLLM has it,
the last message's when the request adds no generation prompt (it continues that message).

With a reasoning parser (``--reasoning-parser``) or tools, each choice's text is split into
reasoning, content and tool calls (``frontend/parsers/output_split.py``); a stream sends a chunk
only when the split has something new, so a held-back marker or a call's unfinished name sends
nothing rather than an empty delta.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.responses import Response
from starlette.types import Receive

from conveyor.frontend.input_processor import ChatOptions, Choice
from conveyor.frontend.output_processor import ChoiceDelta, ChoiceState, LogprobRow
from conveyor.frontend.parsers.output_split import ChoiceSplit, split_output
from conveyor.frontend.parsers.reasoning import ReasoningParser, reasoning_parser
from conveyor.frontend.server.chat_tools import (
    ChatTools,
    call_deltas,
    calls_out,
    chat_tools,
    message_dict,
)
from conveyor.frontend.server.logprobs import chat_logprobs, prompt_logprobs_entries
from conveyor.frontend.server.request_models import (
    ChatCompletionRequest,
    ChatMessage,
    chat_max_tokens,
    chat_num_logprobs,
    chat_template_variables,
    message_text,
    response_id_of,
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
    CompletionTokensDetails,
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
    run = await prepare_chat_run(state, body)
    return await run.respond(receive)


async def prepare_chat_run(state: ServingState, body: ChatCompletionRequest) -> _ChatRun:
    """The chat's engine requests, checked and ready to run: what the other API surfaces that
    are chats underneath (Responses, Messages) translate their requests into."""
    arrival_time = time.monotonic()
    check_model(state, body.model)
    num_logprobs = chat_num_logprobs(body)
    defaults = state.inputs.sampling_defaults
    max_tokens = chat_max_tokens(body, defaults)
    truncating = body.truncate_prompt_tokens is not None
    tools = chat_tools(body, state.inputs.tool_call_parser)
    conversation, size = conversation_of(state, body.messages, truncating)
    options = ChatOptions(
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        add_special_tokens=body.add_special_tokens,
        template_kwargs=chat_template_variables(body),
        tools=tools.tools,
        documents=body.documents,
    )
    vocab_size = state.config.model.vocab_size
    params = to_sampling_params(body, max_tokens, num_logprobs, vocab_size, defaults)
    if tools.schema is not None:
        params = msgspec.structs.replace(params, structured_outputs=tools.structured_outputs())
    prompt, prompt_text, response_id, choices, reasoning = await state.run_cpu_unless_small(
        prepare_size(size, params),
        _prepare,
        state,
        body,
        conversation,
        options,
        max_tokens,
        params,
        arrival_time,
        tools,
    )
    run = _ChatRun(state, body, [prompt], response_id, choices, num_logprobs, tools, reasoning)
    run.role = ROLE if body.add_generation_prompt else conversation[-1]["role"]
    if body.return_prompt_text:
        run.prompt_text = prompt_text
    if body.echo and conversation[-1]["role"] == run.role:
        run.echoed = conversation[-1]["content"]
    return run


def conversation_of(
    state: ServingState, messages: list[ChatMessage], truncating: bool = False
) -> tuple[list[dict[str, Any]], int]:
    """The messages as the chat template takes them, after the checks that cost a ``len``
    (only the body's size bounds a chat that will be truncated), and the size of preparing them
    (see ``LOOP_PREPARE_LIMIT``)."""
    with as_bad_request():
        state.inputs.check_conversation_size(len(messages), 0)
    parser = state.inputs.reasoning_parser
    conversation = [message_dict(m, message_text(m, i), parser) for i, m in enumerate(messages)]
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
    options: ChatOptions,
    max_tokens: int | None,
    params: SamplingParams,
    arrival_time: float,
    tools: ChatTools,
) -> tuple[list[int], str, str, list[Choice], ReasoningParser | None]:
    """The chat template, tokenizing, checks and fan-out: on the CPU pool unless small. Also
    the template's text (for ``return_prompt_text``) and the request's reasoning parser, made
    from the prompt (which may have closed the reasoning already)."""
    inputs = state.inputs
    param = "tools" if tools.schema is not None else structured_param(body)
    reasoning = None
    with as_bad_request():
        text = inputs.chat_text(conversation, options)
        if inputs.reasoning_parser is not None:
            reasoning = reasoning_parser(inputs.reasoning_parser, options.template_kwargs, text)
        if tools.needs_special_tokens or (reasoning is not None and reasoning.needs_special_tokens):
            # The format's markers are special tokens (vLLM's parsers do the same).
            params = msgspec.structs.replace(params, skip_special_tokens=False)
        if reasoning is not None and not reasoning.ended_in_prompt:
            # A constraint applies to the answer, after the reasoning.
            after = reasoning.grammar_prefix(state.tokenizer)
            params = inputs.resolve_structured_outputs(params, param, after)
        prompt = inputs.tokenize(text, options.add_special_tokens)
        prompt = inputs.truncate(prompt, body.truncate_prompt_tokens, body.truncation_side)
    check_prompts(state, [prompt], max_tokens)
    engine_id, choices = make_choices(
        state, [prompt], params, body.priority, arrival_time, bool(body.stream), param,
        body.cache_salt, body.model,
    )  # fmt: skip
    return prompt, text, response_id_of("chatcmpl", body, engine_id), choices, reasoning


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
        reasoning: ReasoningParser | None,
    ) -> None:
        super().__init__(state, body, prompts, response_id, choices)
        self.num_logprobs = num_logprobs
        self.role = ROLE
        # vLLM's return_prompt_text and chat echo (the last message's content, which each
        # answer continues).
        self.prompt_text: str | None = None
        self.echoed = ""
        self._started: set[int] = set()  # choices whose role went out
        self._reasoning = reasoning
        self._include_reasoning = body.include_reasoning is not False
        self._tool_parser = tools.parser if tools.active else None
        self._max_calls = tools.max_calls
        self._splits = {}
        if reasoning is not None or self._tool_parser is not None:
            self._splits = {
                c.state.index: ChoiceSplit(reasoning, self._tool_parser, self._max_calls)
                for c in choices
            }

    def response(self) -> ChatCompletionResponse:
        choices = []
        for c in self.states:
            message, finish_reason = ChatMessageOut(self.role, c.text), c.finish_reason
            if self._splits:
                out = split_output(c.text, self._reasoning, self._tool_parser, self._max_calls)
                message = ChatMessageOut(self.role, out.content, calls_out(out.calls) or None)
                if self._include_reasoning:
                    message.reasoning = out.reasoning
                if out.calls:
                    finish_reason = "tool_calls"
            if self.echoed:
                message.content = self.echoed + (message.content or "")
            logprobs = self._logprobs(c.logprobs)
            choice = ChatChoice(c.index, message, logprobs, finish_reason, c.stop_reason)
            if self.return_token_ids:
                choice.token_ids = c.token_ids
            choices.append(choice)
        response = ChatCompletionResponse(
            self.response_id, self.created, self.state.model_name, choices, self.usage()
        )
        if self.return_token_ids:
            response.prompt_token_ids = self.prompts[0]
        if self.prompt_text is not None:
            response.prompt_text = self.prompt_text
        prompt_rows = self.states[0].prompt_logprobs if self.states else None
        if self.body.prompt_logprobs is not None and prompt_rows is not None:
            response.prompt_logprobs = prompt_logprobs_entries(
                self.state.tokenizer, prompt_rows, self.body.prompt_logprobs
            )
        return response

    async def events(self, source: AsyncIterator[ChoiceDelta]) -> AsyncIterator[bytes]:
        async for event in super().events(source):
            if event:  # a delta the split held back entirely sends nothing
                yield event

    def delta_event(self, delta: ChoiceDelta) -> bytes:
        chunk = self.stream_chunk(delta)
        return b"" if chunk is None else sse_event(chunk)

    def stream_chunk(self, delta: ChoiceDelta) -> ChatCompletionChunk | None:
        """The chunk one delta makes, None if it has nothing to send (what the other API
        surfaces translate, event by event)."""
        first = delta.index not in self._started
        message = ChatDelta(self.role if first else None, delta.text)
        finish_reason = delta.finish_reason
        split = self._splits.get(delta.index)
        if split is not None:
            piece = split.feed(delta.text, done=delta.finish_reason is not None)
            message.content = piece.content or None
            if self._include_reasoning:
                message.reasoning = piece.reasoning or None
            if piece.calls:
                message.tool_calls = call_deltas(piece.calls)
            if split.num_calls and ended_normally(delta):
                finish_reason = "tool_calls"
            with_ids = self.return_token_ids and delta.token_ids
            news = message.content or message.reasoning or message.tool_calls
            if not (news or delta.logprobs or ended_normally(delta) or with_ids):
                return None
        self._started.add(delta.index)
        if first and self.echoed:
            message.content = self.echoed + (message.content or "")
        choice = ChatStreamChoice(delta.index, message, self._logprobs(delta.logprobs))
        if ended_normally(delta):
            choice.finish_reason, choice.stop_reason = finish_reason, delta.stop_reason
        if self.return_token_ids:
            choice.token_ids = delta.token_ids
        chunk = self._chunk([choice], self.shape.usage(delta.index))
        if first and self.return_token_ids:
            chunk.prompt_token_ids = self.prompts[0]
        if first and self.prompt_text is not None:
            chunk.prompt_text = self.prompt_text
        prompt_rows = self.states[delta.index].prompt_logprobs
        if first and self.body.prompt_logprobs is not None and prompt_rows is not None:
            chunk.prompt_logprobs = prompt_logprobs_entries(
                self.state.tokenizer, prompt_rows, self.body.prompt_logprobs
            )
        return chunk

    def usage_event(self) -> bytes:
        return sse_event(self._chunk([], self.usage()))

    def usage(self) -> UsageInfo:
        usage = super().usage()
        if self._reasoning is not None:
            count = sum(
                reasoning_tokens(self.state.tokenizer, c, self._reasoning) for c in self.states
            )
            usage.completion_tokens_details = CompletionTokensDetails(count)
        return usage

    def _chunk(
        self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None
    ) -> ChatCompletionChunk:
        chunk = ChatCompletionChunk(self.response_id, self.created, self.state.model_name, choices)
        chunk.usage = usage
        return chunk

    def _logprobs(self, rows: list[LogprobRow]) -> ChatChoiceLogprobs | None:
        if self.num_logprobs is None:
            return None
        as_ids = bool(self.body.return_tokens_as_token_ids)
        return ChatChoiceLogprobs(
            chat_logprobs(self.state.tokenizer, rows, self.num_logprobs, as_ids)
        )


def reasoning_tokens(tokenizer: Any, choice: ChoiceState, reasoning: ReasoningParser) -> int:
    """How many of the choice's tokens are reasoning: those that start inside the reasoning's
    spans of its text (found by decoding prefixes: a binary search per span end)."""
    token_ids = choice.token_ids[: choice.num_text_tokens]
    skip = choice.sampling_params.skip_special_tokens

    def tokens_before(offset: int) -> int:
        low, high = 0, len(token_ids)
        while low < high:  # the first k whose decoded prefix reaches past ``offset``
            middle = (low + high) // 2
            if len(tokenizer.decode(token_ids[: middle + 1], skip_special_tokens=skip)) > offset:
                high = middle
            else:
                low = middle + 1
        return low

    return sum(
        tokens_before(end) - tokens_before(start) for start, end in reasoning.spans(choice.text)
    )
