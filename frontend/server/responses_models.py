"""OpenAI's Responses API bodies as msgspec Structs: the request, the response object, its output
items and the events of a streamed response.

Runs in an HTTP frontend process. The request is as strict as chat's (``StrictStruct``: a field
this server does not know is a 400 naming it); fields it knows but cannot honour are refused by
``frontend.server.responses`` unless they ask for nothing. Field names and nesting of what goes
out follow OpenAI's API, so the official client (``responses.create``, ``responses.stream``,
``responses.parse``) reads them.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from conveyor.frontend.server.request_models import Int64, StrictStruct, StructuredOutputsField

# ---------------------------------------------------------------- the request


class InputPart(StrictStruct, kw_only=True):
    """A part of an input message's content: ``input_text`` (or an earlier answer's
    ``output_text`` / ``refusal``, as clients send output items back). Images and files are
    named here only to be refused by name."""

    type: str
    text: str | None = None
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None
    refusal: str | None = None
    image_url: Any = None
    file_id: Any = None
    file_data: Any = None
    file_url: Any = None
    filename: Any = None
    detail: Any = None


class InputItem(StrictStruct, kw_only=True):
    """One item of ``input``: a message (``type`` may be left out), an earlier
    ``function_call``, a ``function_call_output`` answering it, or an earlier ``reasoning``
    item (its text goes with the assistant turn after it, where the chat template reads
    reasoning). The fields of every kind are here; each kind's are checked when the items
    become the conversation."""

    type: str = "message"
    id: str | None = None
    status: str | None = None
    # message
    role: str | None = None
    content: str | list[InputPart] | None = None
    phase: str | None = None
    # function_call, function_call_output
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None
    # reasoning
    summary: list[Any] | None = None
    encrypted_content: str | None = None


class FunctionTool(StrictStruct, kw_only=True, omit_defaults=True):
    """A tool; only ``function`` tools exist here (a built-in tool's type is a 400)."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceObject(StrictStruct, kw_only=True, omit_defaults=True):
    """``{"type": "function", "name": N}``: the output is forced to N's arguments."""

    type: str
    name: str | None = None


class TextFormat(StrictStruct, kw_only=True, omit_defaults=True):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (its schema inline)."""

    type: str
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(StrictStruct, kw_only=True, omit_defaults=True):
    format: TextFormat | None = None
    # Only "medium" (or null): the model writes as it writes.
    verbosity: str | None = None


class ReasoningConfig(StrictStruct, kw_only=True):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesStreamOptions(StrictStruct, kw_only=True):
    include_obfuscation: bool | None = None


class ResponsesRequest(StrictStruct, kw_only=True):
    input: str | list[InputItem]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | ToolChoiceObject | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = False
    stream_options: ResponsesStreamOptions | None = None
    # The response is kept (for GET and previous_response_id) unless false.
    store: bool | None = None
    previous_response_id: str | None = None
    # Only "message.output_text.logprobs" (with top_logprobs) and "reasoning.encrypted_content"
    # (no effect: reasoning items carry their text in the clear).
    include: list[str] | None = None
    top_logprobs: Int64 | None = None
    # Only their no-op values: background runs, truncating the conversation, reusable prompts,
    # stored conversations.
    background: bool | None = None
    truncation: str | None = None
    prompt: Any = None
    conversation: Any = None
    # Accepted, no effect: a cap on built-in tool calls (there are none), bookkeeping.
    max_tool_calls: Int64 | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # vLLM's fields of its Responses request.
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    request_id: str | None = None
    priority: Int64 = 0
    cache_salt: str | None = None
    structured_outputs: StructuredOutputsField | None = None

    def __post_init__(self) -> None:
        if self.stream is None:
            self.stream = False


# ---------------------------------------------------------------- the response


class OutputText(msgspec.Struct, tag_field="type", tag="output_text", kw_only=True):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(msgspec.Struct, tag_field="type", tag="message", kw_only=True):
    id: str
    status: str
    content: list[OutputText]
    role: str = "assistant"


class FunctionCallItem(msgspec.Struct, tag_field="type", tag="function_call", kw_only=True):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


class ReasoningText(msgspec.Struct, tag_field="type", tag="reasoning_text", kw_only=True):
    text: str


class ReasoningItem(msgspec.Struct, tag_field="type", tag="reasoning", kw_only=True):
    """What the reasoning parser (``--reasoning-parser``) split out of the answer."""

    id: str
    content: list[ReasoningText]
    status: str
    summary: list[Any] = []


OutputItem = Union[OutputMessage, FunctionCallItem, ReasoningItem]


class InputTokensDetails(msgspec.Struct, frozen=True):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, frozen=True):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()


class IncompleteDetails(msgspec.Struct):
    reason: str


class ResponseError(msgspec.Struct):
    code: str
    message: str


class ReasoningOut(msgspec.Struct, frozen=True):
    effort: str | None = None
    summary: str | None = None


class ResponseObject(msgspec.Struct, kw_only=True):
    id: str
    created_at: int
    model: str
    status: str
    output: list[OutputItem] = []
    object: str = "response"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningOut = ReasoningOut()
    store: bool = False
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    tool_choice: str | ToolChoiceObject = "auto"
    tools: list[FunctionTool] = []
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, Any] = {}
    background: bool = False


class DeletedResponse(msgspec.Struct):
    id: str
    object: str = "response.deleted"
    deleted: bool = True


# ---------------------------------------------------------------- stream events


class _Event(msgspec.Struct, tag_field="type", kw_only=True):
    sequence_number: int = 0


class ResponseCreated(_Event, tag="response.created"):
    response: ResponseObject


class ResponseInProgress(_Event, tag="response.in_progress"):
    response: ResponseObject


class ResponseCompleted(_Event, tag="response.completed"):
    response: ResponseObject


class ResponseFailed(_Event, tag="response.failed"):
    response: ResponseObject


class OutputItemAdded(_Event, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class OutputItemDone(_Event, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class ContentPartAdded(_Event, tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class ContentPartDone(_Event, tag="response.content_part.done"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class ReasoningTextDelta(_Event, tag="response.reasoning_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDone(_Event, tag="response.reasoning_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str


class OutputTextDelta(_Event, tag="response.output_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = []


class OutputTextDone(_Event, tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = []


class ArgumentsDelta(_Event, tag="response.function_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class ArgumentsDone(_Event, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(_Event, tag="error"):
    code: str | None
    message: str
    param: str | None = None


ResponseEvent = Union[
    ResponseCreated,
    ResponseInProgress,
    ResponseCompleted,
    ResponseFailed,
    OutputItemAdded,
    OutputItemDone,
    ContentPartAdded,
    ContentPartDone,
    OutputTextDelta,
    OutputTextDone,
    ReasoningTextDelta,
    ReasoningTextDone,
    ArgumentsDelta,
    ArgumentsDone,
    ErrorEvent,
]

_ENCODER = msgspec.json.Encoder()


def named_event(name: str, body: msgspec.Struct) -> bytes:
    """A server-sent event with its name (``event: NAME``), as OpenAI's and Anthropic's
    streams carry it."""
    return b"event: " + name.encode() + b"\ndata: " + _ENCODER.encode(body) + b"\n\n"
