"""OpenAI response bodies as msgspec Structs: completions, chat, streaming chunks, usage, models.

Runs in an HTTP frontend process. Field names and nesting follow OpenAI's API (and vLLM's
``stop_reason`` extension), so the official client parses them. ``None`` fields are written as
``null`` where OpenAI writes them; only a chat delta omits what it does not carry, and vLLM's
fields a request asks for (``return_token_ids``, ``return_prompt_text``) are left out
(``UNSET``) unless it did.
"""

from __future__ import annotations

import msgspec
from msgspec import UNSET, UnsetType


class CompletionTokensDetails(msgspec.Struct):
    # Of completion_tokens, those of the reasoning (with a reasoning parser).
    reasoning_tokens: int


class UsageInfo(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # OpenAI's, with a reasoning parser only.
    completion_tokens_details: CompletionTokensDetails | UnsetType = UNSET


# ---------------------------------------------------------------- /v1/completions


class CompletionLogprobs(msgspec.Struct):
    """The legacy completions format: parallel lists, one entry per generated token."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class PromptLogprob(msgspec.Struct):
    """One token of one prompt position in vLLM's ``prompt_logprobs`` (keyed by token id)."""

    logprob: float
    rank: int
    decoded_token: str


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # The stop string or stop token id that ended the choice (vLLM's extension).
    stop_reason: int | str | None = None
    # return_token_ids (in a stream: the prompt's with a choice's first chunk).
    prompt_token_ids: list[int] | UnsetType = UNSET
    token_ids: list[int] | UnsetType = UNSET
    # vLLM's prompt_logprobs (in a stream: with a choice's first chunk).
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | UnsetType = UNSET


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    object: str = "text_completion"


# ---------------------------------------------------------------- /v1/chat/completions


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChatChoiceLogprobs(msgspec.Struct):
    content: list[ChatLogprobEntry] | None = None


class FunctionCallOut(msgspec.Struct):
    name: str
    arguments: str


class ToolCallOut(msgspec.Struct):
    id: str
    function: FunctionCallOut
    type: str = "function"


class ChatMessageOut(msgspec.Struct, omit_defaults=True):
    role: str
    # Always written, null when the message is only tool calls (as OpenAI writes it).
    content: str | None
    tool_calls: list[ToolCallOut] | None = None
    # vLLM's: what a reasoning parser split out of the content.
    reasoning: str | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessageOut
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | UnsetType = UNSET  # return_token_ids


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    object: str = "chat.completion"
    prompt_token_ids: list[int] | UnsetType = UNSET  # return_token_ids
    prompt_text: str | UnsetType = UNSET  # return_prompt_text
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | UnsetType = UNSET


class FunctionDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionDelta | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    # The first chunk of a choice carries the role, later ones only content.
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None  # vLLM's, with a reasoning parser
    tool_calls: list[ToolCallDelta] | None = None


class ChatStreamChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | UnsetType = UNSET  # return_token_ids: this chunk's


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    object: str = "chat.completion.chunk"
    # With a choice's first chunk: return_token_ids, return_prompt_text.
    prompt_token_ids: list[int] | UnsetType = UNSET
    prompt_text: str | UnsetType = UNSET
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | UnsetType = UNSET


# ---------------------------------------------------------------- /v1/models


class ModelCard(msgspec.Struct):
    id: str
    created: int
    max_model_len: int
    owned_by: str = "conveyor"
    object: str = "model"
    # A LoRA adapter's base model (vLLM's field); None for the base model itself.
    parent: str | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


_ENCODER = msgspec.json.Encoder()


def encode_json(body: msgspec.Struct) -> bytes:
    return _ENCODER.encode(body)


def sse_event(body: msgspec.Struct) -> bytes:
    """One server-sent event: ``data: {json}`` and a blank line."""
    return b"data: " + _ENCODER.encode(body) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
