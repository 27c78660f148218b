"""A chat request's tools: which ``tool_choice`` it has, what the template and the sampler get,
and how each choice's output becomes content and tool calls.

Runs in an HTTP frontend process. Calls come out two ways: the model's own format, read by the
parser chosen with ``--tool-call-parser`` (``auto``; ``frontend/parsers/tool_calls/``), or a
JSON format a grammar forces (``required`` and a named function;
``frontend/parsers/tool_calls/forced.py``). Either streams through one ``ToolCallStream``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from conveyor.frontend.parsers.reasoning import history_fields
from conveyor.frontend.parsers.tool_calls import tool_call_parser
from conveyor.frontend.parsers.tool_calls.base import ToolCall, ToolCallParser
from conveyor.frontend.parsers.tool_calls.forced import (
    NamedCallParser,
    RequiredCallsParser,
    forced_schema,
)
from conveyor.frontend.parsers.tool_calls.stream import CallDelta
from conveyor.frontend.server.errors import bad_request
from conveyor.frontend.server.request_models import ChatCompletionRequest, NamedToolChoice
from conveyor.frontend.server.response_models import (
    FunctionCallOut,
    FunctionDelta,
    ToolCallDelta,
    ToolCallOut,
)
from conveyor.protocol import StructuredOutputsParams


@dataclass(frozen=True)
class ChatTools:
    """``mode``: "none", "auto", "required" or "named"; ``tools`` go into the template."""

    mode: str
    tools: list[dict[str, Any]] | None = None
    named: str | None = None
    # auto: the model's format; required / named: the forced one.
    parser: ToolCallParser | None = None
    # For required / named: the schema that forces the output.
    schema: dict[str, Any] | None = None
    # parallel_tool_calls: false keeps one call (auto: the first the model writes; required:
    # the schema allows one).
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def structured_outputs(self) -> StructuredOutputsParams | None:
        return None if self.schema is None else StructuredOutputsParams(json=self.schema)

    @property
    def needs_special_tokens(self) -> bool:
        return self.parser is not None and self.parser.needs_special_tokens

    @property
    def max_calls(self) -> int | None:
        """The calls kept (None: all)."""
        return None if self.parallel else 1


def chat_tools(body: ChatCompletionRequest, parser_name: str | None) -> ChatTools:
    """The request's tool setup, or a 400 naming what does not fit."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        if body.parallel_tool_calls is not None:
            raise bad_request("parallel_tool_calls needs tools", "parallel_tool_calls")
        return ChatTools("none")
    for i, tool in enumerate(body.tools):
        if tool.type != "function":
            raise bad_request(f"tools[{i}]: only function tools exist here", f"tools[{i}].type")
    if isinstance(choice, NamedToolChoice) and choice.type != "function":
        raise bad_request("a named tool_choice must be of type function", "tool_choice")
    tools = [tool_dict(tool) for tool in body.tools]
    names = [tool["function"]["name"] for tool in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct function names", "tools")
    choice = "auto" if choice is None else choice
    if choice == "none":
        return ChatTools("none")
    if isinstance(choice, NamedToolChoice) or choice == "required":
        if body.structured_outputs is not None or (
            body.response_format is not None and body.response_format.type != "text"
        ):
            raise bad_request(
                "a required or named tool_choice already constrains the output; drop "
                "response_format / structured_outputs",
                "tool_choice",
            )
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        if named is not None and named not in names:
            raise bad_request(f"tool_choice names {named!r}, not among the tools", "tool_choice")
        parallel = body.parallel_tool_calls is not False
        schema = forced_schema(tools, named, parallel)
        if named is not None:
            return ChatTools("named", tools, named, NamedCallParser(named), schema, parallel)
        return ChatTools("required", tools, None, RequiredCallsParser(), schema, parallel)
    if choice != "auto":
        raise bad_request(
            f"tool_choice must be none, auto, required or a named function, got {choice!r}",
            "tool_choice",
        )
    if parser_name is None:
        raise bad_request(
            'tool_choice "auto" needs the server started with --enable-auto-tool-choice and '
            "--tool-call-parser",
            "tool_choice",
        )
    parallel = body.parallel_tool_calls is not False
    return ChatTools("auto", tools, parser=tool_call_parser(parser_name, tools), parallel=parallel)


def tool_dict(tool: Any) -> dict[str, Any]:
    """A tool definition as the chat template takes it."""
    return {"type": "function", "function": _function(tool.function)}


def _function(function: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"name": function.name}
    if function.description is not None:
        out["description"] = function.description
    out["parameters"] = function.parameters or {"type": "object", "properties": {}}
    return out


def calls_out(calls: list[ToolCall]) -> list[ToolCallOut]:
    return [ToolCallOut(c.id, FunctionCallOut(c.name, c.arguments)) for c in calls]


def call_deltas(pieces: list[CallDelta]) -> list[ToolCallDelta]:
    """vLLM's stream shape: a call's index, id, type and name first, then its arguments in
    fragments as the model writes them."""
    deltas = []
    for piece in pieces:
        if piece.name is not None:
            deltas.append(
                ToolCallDelta(piece.index, piece.id, "function", FunctionDelta(piece.name))
            )
        else:
            deltas.append(
                ToolCallDelta(piece.index, function=FunctionDelta(arguments=piece.arguments))
            )
    return deltas


def message_dict(message: Any, text: str, reasoning_parser: str | None = None) -> dict[str, Any]:
    """A history message as the chat template takes it (OpenAI's shape: assistant tool calls
    and tool results are rendered, not dropped; an earlier answer's reasoning under the names
    the family's template reads)."""
    out: dict[str, Any] = {"role": message.role, "content": text}
    reasoning = message.reasoning if message.reasoning is not None else message.reasoning_content
    if reasoning is not None:
        out.update(history_fields(reasoning_parser, reasoning))
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": call.type,
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out
