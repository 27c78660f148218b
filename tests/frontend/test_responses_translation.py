"""The Responses API's translations, without a server: input items -> chat messages, and chat
deltas -> Responses events, read back by the official client's own stream accumulator (the
one ``client.responses.stream()`` runs), reasoning items included (what a server started with
``--reasoning-parser`` writes).
"""

from __future__ import annotations

import json
import re

import msgspec
import pytest
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from conveyor.frontend.server.errors import ApiError
from conveyor.frontend.server.response_models import (
    ChatChoice,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    FunctionCallOut,
    FunctionDelta,
    ToolCallDelta,
    ToolCallOut,
    UsageInfo,
)
from conveyor.frontend.server.responses import _as_messages, _output_items
from conveyor.frontend.server.responses_input import input_messages, renamed
from conveyor.frontend.server.responses_models import InputItem, ResponseObject
from conveyor.frontend.server.responses_stream import ResponseEvents


def _items(raw: list[dict]) -> list[InputItem]:
    return msgspec.convert(raw, list[InputItem])


def _replayed(stream: bytes) -> tuple[list[str], object]:
    """Every event through the client's accumulator; (event types, the final response)."""
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    names = re.findall(rb"^event: (\S+)$", stream, re.M)
    datas = [json.loads(d) for d in re.findall(rb"^data: (.*)$", stream, re.M)]
    types = []
    for name, data in zip(names, datas):
        assert name.decode() == data["type"]
        types.append(data["type"])
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=data))
    return types, state._completed_response


def _response(output: list, status: str = "completed") -> ResponseObject:
    return ResponseObject(id="resp_1", created_at=0, model="m", status=status, output=output)


def test_reasoning_text_and_calls_stream_as_the_client_reads_them():
    events = ResponseEvents()
    stream = events.created(_response([], "in_progress"))
    call = [ToolCallDelta(0, "call_1", "function", FunctionDelta("get_weather"))]
    args = [ToolCallDelta(0, function=FunctionDelta(arguments='{"city": ')),
            ToolCallDelta(0, function=FunctionDelta(arguments='"Rome"}'))]  # fmt: skip
    for delta in [ChatDelta("assistant", reasoning="Think"), ChatDelta(reasoning="ing."),
                  ChatDelta(content="Hi"), ChatDelta(content=" there"),
                  ChatDelta(tool_calls=call), ChatDelta(tool_calls=args)]:  # fmt: skip
        stream += b"".join(events.chat_delta(delta, None))
    stream += b"".join(events.close())
    stream += events.completed(_response(events.items()))
    types, final = _replayed(stream)
    assert types == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    reasoning, message, function_call = final.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Thinking."
    assert final.output_text == "Hi there"
    assert (function_call.call_id, function_call.name) == ("call_1", "get_weather")
    assert json.loads(function_call.arguments) == {"city": "Rome"}
    # The conversation a later previous_response_id continues: one assistant turn.
    (turn,) = _as_messages(events.items())
    assert (turn.role, turn.content, turn.reasoning) == ("assistant", "Hi there", "Thinking.")
    assert turn.tool_calls[0].function.arguments == '{"city": "Rome"}'


def test_a_failed_stream_ends_with_an_error_and_failed():
    events = ResponseEvents()
    stream = events.created(_response([], "in_progress"))
    stream += b"".join(events.chat_delta(ChatDelta("assistant", "Hi"), None))
    stream += events.failed(_response(events.items(), "failed"), "503", "the engine failed")
    datas = [json.loads(d) for d in re.findall(rb"^data: (.*)$", stream, re.M)]
    assert [d["type"] for d in datas][-2:] == ["error", "response.failed"]
    assert datas[-2]["message"] == "the engine failed"
    assert datas[-1]["response"]["error"] == {"code": "503", "message": "the engine failed"}
    assert [d["sequence_number"] for d in datas] == list(range(len(datas)))


def test_a_whole_chat_response_becomes_output_items():
    message = ChatMessageOut(
        "assistant",
        "Hi",
        [ToolCallOut("call_9", FunctionCallOut("f", "{}"))],
        reasoning="Because.",
    )
    chat = ChatCompletionResponse("c", 0, "m", [ChatChoice(0, message)], UsageInfo(1, 2, 3))
    items = _output_items(chat)
    assert [type(i).__name__ for i in items] == [
        "ReasoningItem",
        "OutputMessage",
        "FunctionCallItem",
    ]
    assert items[2].call_id == "call_9" and items[1].content[0].text == "Hi"
    only_calls = ChatMessageOut("assistant", None, [ToolCallOut("c", FunctionCallOut("f", "{}"))])
    chat.choices = [ChatChoice(0, only_calls)]
    assert [type(i).__name__ for i in _output_items(chat)] == ["FunctionCallItem"]


def test_input_items_become_chat_messages():
    messages = input_messages(_items([
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                     {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "c"}]},
        {"type": "function_call", "call_id": "x", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "y", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "x", "output": "1"},
        {"type": "function_call_output", "call_id": "y", "output": [{"type": "input_text", "text": "2"}]},
    ]))  # fmt: skip
    assert [(m.role, m.content) for m in messages] == [
        ("system", "rules"), ("user", "ab"), ("assistant", "c"), ("tool", "1"), ("tool", "2"),
    ]  # fmt: skip
    assistant = messages[2]
    assert assistant.reasoning == "hmm"
    assert [c.id for c in assistant.tool_calls] == ["x", "y"]
    assert [m.tool_call_id for m in messages[3:]] == ["x", "y"]


@pytest.mark.parametrize(
    "raw, param",
    [
        ([{"role": "tool", "content": "x"}], "input[0].role"),
        ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0]"),
        ([{"type": "function_call_output", "call_id": "x"}], "input[0]"),
        ([{"type": "item_reference", "id": "x"}], "input[0].type"),
        ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}],
         "input[0].content[0]"),
    ],
)  # fmt: skip
def test_items_that_cannot_be_rendered_are_named(raw, param):
    with pytest.raises(ApiError) as error:
        input_messages(_items(raw))
    assert error.value.param == param


def test_chat_errors_name_the_responses_fields():
    assert renamed(ApiError(400, "x", "max_tokens")).param == "max_output_tokens"
    assert renamed(ApiError(400, "x", "response_format")).param == "text.format"
    assert renamed(ApiError(400, "x", "messages")).param == "input"
    assert renamed(ApiError(400, "x", "temperature")).param == "temperature"
