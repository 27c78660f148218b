"""An Anthropic Messages request as the chat request it is underneath: its messages and content
blocks as chat messages, its options as chat's fields.

Runs in an HTTP frontend process, on its event loop (one pass over the messages, whose number
the body's size and the context bound). What Messages has and chat lacks is refused here by
name (server tools, MCP servers, containers, images); the rest is chat's, checked by chat's
pipeline, whose errors name the Messages fields (``RENAMED_PARAMS``).
"""

from __future__ import annotations

import json
from typing import Any

from conveyor.frontend.server.errors import ApiError, bad_request
from conveyor.frontend.server.messages_models import (
    AnthropicToolChoice,
    ContentBlock,
    MessagesRequest,
    PromptFields,
)
from conveyor.frontend.server.request_models import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCallIn,
    FunctionDef,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    ToolCallIn,
    ToolDef,
)

# Chat's field in an error -> the Messages field a client sent.
RENAMED_PARAMS = {
    "max_completion_tokens": "max_tokens",
    "stop": "stop_sequences",
    "response_format": "output_config.format",
    "reasoning_effort": "output_config.effort",
    "chat_template_kwargs": "thinking",
}
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_THINKING = ("enabled", "adaptive", "disabled")


def renamed(error: ApiError) -> ApiError:
    """Chat's error as the Messages request's: the field it names, and says, as sent."""
    if error.param is not None:
        base = error.param.split(".", 1)[0].split("[", 1)[0]
        if base in RENAMED_PARAMS:
            error.message = f"{RENAMED_PARAMS[base]}: {error.message}"
            error.param = RENAMED_PARAMS[base]
    return error


def chat_request(body: PromptFields) -> ChatCompletionRequest:
    """The chat request ``body`` is (``count_tokens`` gives only what decides the prompt)."""
    check_supported(body)
    thinking = body.thinking.type if body.thinking else None
    messages = [ChatMessage("system", _system(body.system))] if body.system else []
    for i, message in enumerate(body.messages):
        messages += _messages(message.role, message.content, i)
    sampling: dict[str, Any] = {}
    if isinstance(body, MessagesRequest):
        sampling = dict(
            max_tokens=body.max_tokens,
            stop=body.stop_sequences,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            stream=body.stream,
        )
    output = body.output_config
    return ChatCompletionRequest(
        messages=messages,
        model=body.model,
        tools=[_tool(tool, i) for i, tool in enumerate(body.tools)] if body.tools else None,
        tool_choice=_tool_choice(body.tool_choice),
        parallel_tool_calls=_parallel(body.tool_choice) if body.tools else None,
        chat_template_kwargs=None
        if thinking is None
        else {"enable_thinking": thinking != "disabled"},
        reasoning_effort=output.effort if output else None,
        response_format=_response_format(output.format if output else None),
        **sampling,
    )


def check_supported(body: PromptFields) -> None:
    """400 for what would change the result and is not implemented."""
    for name in ("mcp_servers", "container", "context_management"):
        if getattr(body, name) not in (None, [], {}):
            raise bad_request(f"{name}: not supported by this server", name)
    if body.thinking is not None and body.thinking.type not in _THINKING:
        raise bad_request(f"thinking.type must be one of {', '.join(_THINKING)}", "thinking")


def _system(system: str | list[ContentBlock]) -> str:
    if isinstance(system, str):
        return system
    return "".join(_block_text(block, f"system[{i}]") for i, block in enumerate(system))


def _messages(role: str, content: str | list[ContentBlock], index: int) -> list[ChatMessage]:
    """One Anthropic message as chat messages: an assistant's text, thinking and tool uses
    make one message; a user's tool results become tool messages (in their order), its text
    a user message."""
    if role not in ("user", "assistant"):
        raise bad_request(
            f"messages[{index}].role must be user or assistant", f"messages[{index}].role"
        )
    if isinstance(content, str):
        return [ChatMessage(role, content)]
    if role == "assistant":
        return [_assistant(content, index)]
    out: list[ChatMessage] = []
    texts: list[str] = []
    for j, block in enumerate(content):
        param = f"messages[{index}].content[{j}]"
        if block.type == "tool_result":
            if texts:
                out.append(ChatMessage("user", "".join(texts)))
                texts = []
            if block.tool_use_id is None:
                raise bad_request(f"{param}: a tool_result needs tool_use_id", param)
            result = _result_text(block.content, param)
            out.append(ChatMessage("tool", result, tool_call_id=block.tool_use_id))
        else:
            texts.append(_block_text(block, param))
    if texts or not out:
        out.append(ChatMessage("user", "".join(texts)))
    return out


def _assistant(content: list[ContentBlock], index: int) -> ChatMessage:
    texts, thoughts, calls = [], [], []
    for j, block in enumerate(content):
        param = f"messages[{index}].content[{j}]"
        if block.type == "tool_use":
            if block.id is None or block.name is None:
                raise bad_request(f"{param}: a tool_use needs id and name", param)
            arguments = json.dumps(block.input or {}, ensure_ascii=False)
            calls.append(ToolCallIn(block.id, FunctionCallIn(block.name, arguments)))
        elif block.type == "thinking":
            thoughts.append(block.thinking or "")
        elif block.type != "redacted_thinking":  # encrypted elsewhere: nothing to render
            texts.append(_block_text(block, param))
    message = ChatMessage("assistant", "".join(texts), tool_calls=calls or None)
    message.reasoning = "".join(thoughts) or None
    return message


def _block_text(block: ContentBlock, param: str) -> str:
    if block.type != "text" or block.text is None:
        raise bad_request(
            f"{param}: a {block.type!r} block is not supported here (text, tool_use, "
            "tool_result and thinking are)",
            param,
        )
    return block.text


def _result_text(content: str | list[ContentBlock] | None, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(_block_text(block, f"{param}.content[{k}]") for k, block in enumerate(content))


def _tool(tool: Any, index: int) -> ToolDef:
    if tool.type not in (None, "custom"):
        raise bad_request(
            f"tools[{index}].type: {tool.type!r} is a server tool this server does not have "
            "(only client tools are)",
            f"tools[{index}].type",
        )
    function = FunctionDef(
        name=tool.name,
        description=tool.description,
        parameters=tool.input_schema,
        strict=tool.strict,
    )
    return ToolDef(function)


def _tool_choice(choice: AnthropicToolChoice | None) -> str | NamedToolChoice | None:
    if choice is None:
        return None
    if choice.type == "tool":
        if choice.name is None:
            raise bad_request('tool_choice "tool" needs the tool\'s name', "tool_choice")
        return NamedToolChoice(NamedFunction(choice.name))
    if choice.type not in _TOOL_CHOICES:
        raise bad_request(
            f"tool_choice.type must be auto, any, tool or none, got {choice.type!r}",
            "tool_choice",
        )
    return _TOOL_CHOICES[choice.type]


def _parallel(choice: AnthropicToolChoice | None) -> bool | None:
    if choice is None or choice.disable_parallel_tool_use is None:
        return None
    return not choice.disable_parallel_tool_use


def _response_format(output_format: Any) -> ResponseFormat | None:
    if output_format is None:
        return None
    if output_format.type != "json_schema" or output_format.schema is None:
        raise bad_request(
            "output_config.format must be {type: json_schema, schema: ...}", "output_config"
        )
    schema = JsonSchemaFormat(schema=output_format.schema)
    return ResponseFormat(type="json_schema", json_schema=schema)
