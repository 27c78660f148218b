"""Anthropic's Messages API bodies as msgspec Structs: the request, the message object, its
content blocks and the events of a streamed message.

Runs in an HTTP frontend process. The request is as strict as chat's (``StrictStruct``: a field
this server does not know is a 400 naming it); fields it knows but cannot honour are refused by
``frontend.server.messages_input`` unless they ask for nothing. What goes out follows
Anthropic's API, so the official ``anthropic`` client (``messages.create``, ``messages.stream``,
``messages.count_tokens``) reads it.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from conveyor.frontend.server.request_models import Int64, StrictStruct

# ---------------------------------------------------------------- the request


class ContentBlock(StrictStruct, kw_only=True):
    """A block of a message's content: ``text``; an assistant's ``tool_use`` (and its
    ``thinking``, or ``redacted_thinking``, which is not rendered); a user's ``tool_result``.
    The fields of every kind are here; images and documents are named only to be refused by
    their type."""

    type: str
    text: str | None = None
    # tool_use
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    # tool_result
    tool_use_id: str | None = None
    content: str | list[ContentBlock] | None = None
    is_error: bool | None = None
    # thinking, redacted_thinking
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None
    # Any block: a prompt-cache breakpoint (the prefix cache needs none), citations.
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None
    # image, document
    source: Any = None
    title: Any = None
    context: Any = None


class AnthropicMessage(StrictStruct):
    role: str
    content: str | list[ContentBlock]


class AnthropicTool(StrictStruct, kw_only=True):
    """A client tool (``type`` absent or ``custom``); a server tool's type is a 400."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None
    strict: bool | None = None
    cache_control: dict[str, Any] | None = None


class AnthropicToolChoice(StrictStruct, kw_only=True):
    """``auto``, ``any`` (a call is required), ``tool`` (that one: ``name``) or ``none``."""

    type: str
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(StrictStruct, kw_only=True):
    """``enabled`` (with its ``budget_tokens``, a target Anthropic's models need not meet
    either: not enforced here), ``adaptive`` or ``disabled``."""

    type: str
    budget_tokens: Int64 | None = None
    display: str | None = None


class OutputFormat(StrictStruct, kw_only=True):
    type: str
    schema: dict[str, Any] | None = None


class OutputConfig(StrictStruct, kw_only=True):
    effort: str | None = None
    format: OutputFormat | None = None


class PromptFields(StrictStruct, kw_only=True):
    """What decides the prompt: the fields ``count_tokens`` takes too."""

    messages: list[AnthropicMessage]
    model: str | None = None
    system: str | list[ContentBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # Accepted, no effect: automatic prompt caching's breakpoint (the prefix cache needs
    # none), the speed mode, whom and which workspace a request is for.
    cache_control: dict[str, Any] | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # Only their no-op value: MCP servers, code-execution containers, context editing.
    mcp_servers: Any = None
    container: Any = None
    context_management: Any = None


class MessagesRequest(PromptFields, kw_only=True):
    max_tokens: Int64
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    stream: bool | None = False
    # Accepted, no effect: bookkeeping, routing, and prompt-cache diagnostics (none are
    # reported: the prefix cache's hits are in usage.cache_read_input_tokens).
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    inference_geo: str | None = None
    diagnostics: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.stream is None:
            self.stream = False


class CountTokensRequest(PromptFields, kw_only=True):
    pass


# ---------------------------------------------------------------- the message


class TextBlock(msgspec.Struct, tag_field="type", tag="text", kw_only=True):
    text: str


class ToolUseBlock(msgspec.Struct, tag_field="type", tag="tool_use", kw_only=True):
    id: str
    name: str
    input: dict[str, Any]


class ThinkingBlock(msgspec.Struct, tag_field="type", tag="thinking", kw_only=True):
    """What the reasoning parser (``--reasoning-parser``) split out of the answer; unsigned."""

    thinking: str
    signature: str = ""


OutputBlock = Union[TextBlock, ToolUseBlock, ThinkingBlock]


class MessageUsage(msgspec.Struct):
    # As Anthropic counts them: input_tokens are the prompt's tokens the prefix cache did not
    # hold; cache_read_input_tokens the ones it did.
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageObject(msgspec.Struct, kw_only=True):
    id: str
    model: str
    content: list[OutputBlock]
    usage: MessageUsage
    stop_reason: str | None = None
    stop_sequence: str | None = None
    type: str = "message"
    role: str = "assistant"


class TokenCount(msgspec.Struct):
    input_tokens: int


# ---------------------------------------------------------------- stream events


class TextDelta(msgspec.Struct, tag_field="type", tag="text_delta"):
    text: str


class InputJsonDelta(msgspec.Struct, tag_field="type", tag="input_json_delta"):
    partial_json: str


class ThinkingDelta(msgspec.Struct, tag_field="type", tag="thinking_delta"):
    thinking: str


BlockDelta = Union[TextDelta, InputJsonDelta, ThinkingDelta]


class MessageStart(msgspec.Struct, tag_field="type", tag="message_start"):
    message: MessageObject


class ContentBlockStart(msgspec.Struct, tag_field="type", tag="content_block_start"):
    index: int
    content_block: OutputBlock


class ContentBlockDelta(msgspec.Struct, tag_field="type", tag="content_block_delta"):
    index: int
    delta: BlockDelta


class ContentBlockStop(msgspec.Struct, tag_field="type", tag="content_block_stop"):
    index: int


class StopFields(msgspec.Struct):
    stop_reason: str | None
    stop_sequence: str | None = None


class OutputUsage(msgspec.Struct):
    output_tokens: int


class MessageDelta(msgspec.Struct, tag_field="type", tag="message_delta"):
    delta: StopFields
    usage: OutputUsage


class MessageStop(msgspec.Struct, tag_field="type", tag="message_stop"):
    pass
