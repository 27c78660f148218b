"""The Responses API's translations, without a server: input items -> chat messages, a whole
chat response -> output items, reasoning items included (what a server started with
``--reasoning-parser`` writes).
"""

from __future__ import annotations

import msgspec
import pytest

from conveyor.frontend.server.errors import ApiError
from conveyor.frontend.server.response_models import (
    ChatChoice,
    ChatCompletionResponse,
    ChatMessageOut,
    FunctionCallOut,
    ToolCallOut,
    UsageInfo,
)
from conveyor.frontend.server.responses import _output_items
from conveyor.frontend.server.responses_input import input_messages, renamed
from conveyor.frontend.server.responses_models import InputItem


def _items(raw: list[dict]) -> list[InputItem]:
    return msgspec.convert(raw, list[InputItem])


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
