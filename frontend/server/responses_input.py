"""A Responses request as the chat request it is underneath: its input items as chat messages,
its options as chat's fields.

Runs in an HTTP frontend process, on its event loop (the work is one pass over the items, whose
number the body's size and the context bound). What Responses has and chat lacks is refused
here by name (built-in tools, background runs, truncation, reusable prompts); the rest is
chat's, checked by chat's pipeline, whose errors name Responses' fields (``RENAMED_PARAMS``).
"""

from __future__ import annotations

from typing import Any

from conveyor.frontend.server.errors import ApiError, bad_request
from conveyor.frontend.server.request_models import (
    REASONING_EFFORTS,
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
from conveyor.frontend.server.responses_models import (
    InputItem,
    InputPart,
    ResponsesRequest,
    ToolChoiceObject,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# What include may ask for: output logprobs, and encrypted reasoning (reasoning items carry their
# text in the clear: nothing is encrypted, and a later request reads it back as it is).
INCLUDES = (LOGPROBS_INCLUDE, "reasoning.encrypted_content")
# Chat's field in an error -> the Responses field a client sent.
RENAMED_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
    "logprobs": "include",
}
_TEXT_PARTS = ("input_text", "output_text", "text")
# Roles a message item may have; OpenAI's "developer" is what chat templates call "system".
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def renamed(error: ApiError) -> ApiError:
    """Chat's error as the Responses request's: the field it names as the client sent it."""
    if error.param is not None:
        head, dot, rest = error.param.partition(".")
        base = head.split("[", 1)[0]
        if base in RENAMED_PARAMS:
            error.param = RENAMED_PARAMS[base] + (dot + rest if base == head else "")
    return error


def check_supported(body: ResponsesRequest) -> None:
    """400 for what would change the result and is not implemented."""
    refused = {
        "background": (body.background, (None, False), "background responses are not run"),
        "truncation": (body.truncation, (None, "disabled"), "the input is never truncated"),
        "prompt": (body.prompt, (None,), "reusable prompts are not supported"),
        "conversation": (body.conversation, (None,), "use previous_response_id"),
    }
    for name, (value, no_op, reason) in refused.items():
        if value not in no_op:
            raise bad_request(f"{name}: {reason} here", name)
    for item in body.include or ():
        if item not in INCLUDES:
            raise bad_request(f"include: only {', '.join(INCLUDES)}, got {item!r}", "include")
    if body.text is not None and body.text.verbosity not in (None, "medium"):
        raise bad_request("text.verbosity: only medium (the model writes as it writes)", "text")
    reasoning = body.reasoning
    if reasoning is not None:
        if reasoning.summary is not None or reasoning.generate_summary is not None:
            raise bad_request(
                "reasoning.summary: reasoning summaries are not written here", "reasoning.summary"
            )
        if reasoning.effort is not None and reasoning.effort not in REASONING_EFFORTS:
            raise bad_request(
                f"reasoning.effort must be one of {', '.join(REASONING_EFFORTS)}",
                "reasoning.effort",
            )


def chat_request(body: ResponsesRequest, history: list[ChatMessage]) -> ChatCompletionRequest:
    """The chat request ``body`` is: ``history`` (a previous response's conversation), then
    its own input, after its instructions."""
    messages = [ChatMessage("system", body.instructions)] if body.instructions else []
    messages += history
    messages += input_messages(body.input)
    logprobs = LOGPROBS_INCLUDE in (body.include or ())
    return ChatCompletionRequest(
        messages=messages,
        model=body.model,
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        seed=body.seed,
        stop=body.stop,
        ignore_eos=body.ignore_eos,
        logit_bias=body.logit_bias,
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        request_id=body.request_id,
        priority=body.priority,
        cache_salt=body.cache_salt,
        structured_outputs=body.structured_outputs,
        response_format=_response_format(body),
        tools=[_tool(tool, i) for i, tool in enumerate(body.tools)] if body.tools else None,
        tool_choice=_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        reasoning_effort=body.reasoning.effort if body.reasoning else None,
        logprobs=logprobs,
        top_logprobs=body.top_logprobs if logprobs else None,
        stream=body.stream,
    )


def input_messages(items: str | list[InputItem]) -> list[ChatMessage]:
    """The input items as chat messages: consecutive function calls join one assistant
    message (the one before them, if it is the assistant's); a reasoning item's text is the
    reasoning of the assistant turn after it (rendered where the chat template reads an earlier
    turn's reasoning, as chat renders it)."""
    if isinstance(items, str):
        return [ChatMessage("user", items)]
    messages: list[ChatMessage] = []
    reasoning: list[str] = []  # of reasoning items waiting for their assistant turn
    for i, item in enumerate(items):
        last = messages[-1] if messages else None
        if item.type == "message":
            role = _ROLES.get(item.role or "")
            if role is None:
                raise bad_request(
                    f"input[{i}].role must be one of {', '.join(_ROLES)}", f"input[{i}].role"
                )
            messages.append(ChatMessage(role, _text(item.content, f"input[{i}].content")))
        elif item.type == "function_call":
            call = _call(item, i)
            if last is not None and last.role == "assistant" and not reasoning:
                last.tool_calls = [*(last.tool_calls or ()), call]
            else:
                messages.append(ChatMessage("assistant", None, tool_calls=[call]))
        elif item.type == "reasoning":
            reasoning.append(_reasoning_text(item, i))
            continue
        elif item.type == "function_call_output":
            if item.call_id is None or item.output is None:
                raise bad_request(
                    f"input[{i}]: a function_call_output needs call_id and output", f"input[{i}]"
                )
            output = _text(item.output, f"input[{i}].output")
            messages.append(ChatMessage("tool", output, tool_call_id=item.call_id))
        else:
            raise bad_request(
                f"input[{i}].type: {item.type!r} items are not supported (message, "
                "function_call, function_call_output and reasoning are)",
                f"input[{i}].type",
            )
        if reasoning and messages[-1].role == "assistant":
            messages[-1].reasoning = "".join(reasoning)
        reasoning = []
    return messages


def _reasoning_text(item: InputItem, index: int) -> str:
    """An earlier reasoning item's text: its ``reasoning_text`` parts (as this server writes
    them), else its summary's texts."""
    parts = [part for part in item.content or () if not isinstance(part, str)]
    texts = [part.text for part in parts if part.type == "reasoning_text" and part.text]
    if not texts:
        texts = [s["text"] for s in item.summary or () if isinstance(s, dict) and "text" in s]
    if isinstance(item.content, str):
        texts = [item.content]
    return "\n".join(texts)


def _text(content: str | list[InputPart] | None, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type not in _TEXT_PARTS or part.text is None:
            if part.type == "refusal" and part.refusal is not None:
                texts.append(part.refusal)
                continue
            raise bad_request(f"{param}[{j}]: only text parts are supported", f"{param}[{j}]")
        texts.append(part.text)
    return "".join(texts)


def _call(item: InputItem, index: int) -> ToolCallIn:
    if item.call_id is None or item.name is None or item.arguments is None:
        raise bad_request(
            f"input[{index}]: a function_call needs call_id, name and arguments",
            f"input[{index}]",
        )
    return ToolCallIn(item.call_id, FunctionCallIn(item.name, item.arguments))


def _tool(tool: Any, index: int) -> ToolDef:
    if tool.type != "function":
        raise bad_request(
            f"tools[{index}].type: {tool.type!r} is a built-in tool this server does not have "
            "(only function tools are)",
            f"tools[{index}].type",
        )
    if tool.name is None:
        raise bad_request(f"tools[{index}] needs a name", f"tools[{index}].name")
    function = FunctionDef(
        name=tool.name,
        description=tool.description,
        parameters=tool.parameters,
        strict=tool.strict,
    )
    return ToolDef(function)


def _tool_choice(choice: str | ToolChoiceObject | None) -> str | NamedToolChoice | None:
    if not isinstance(choice, ToolChoiceObject):
        return choice
    if choice.type != "function" or choice.name is None:
        raise bad_request(
            "tool_choice: a tool_choice object must name a function "
            '({"type": "function", "name": ...})',
            "tool_choice",
        )
    return NamedToolChoice(NamedFunction(choice.name))


def _response_format(body: ResponsesRequest) -> ResponseFormat | None:
    text_format = body.text.format if body.text is not None else None
    if text_format is None or text_format.type == "text":
        return None
    schema = JsonSchemaFormat(
        name=text_format.name,
        description=text_format.description,
        schema=text_format.schema,
        strict=text_format.strict,
    )
    return ResponseFormat(
        type=text_format.type, json_schema=schema if text_format.type == "json_schema" else None
    )
