"""Anthropic's Messages API translations, without a server: messages and content blocks -> chat
messages, and chat deltas -> Anthropic's stream events, read back by the official client's own
accumulator (the one ``client.messages.stream()`` runs), thinking blocks included (what a
server started with ``--reasoning-parser`` writes).
"""

from __future__ import annotations

import json
import re

import msgspec
import pytest
from anthropic.lib.streaming._messages import accumulate_event

from conveyor.frontend.server.errors import ApiError
from conveyor.frontend.server.messages import _blocks, _stop_reason
from conveyor.frontend.server.messages_input import chat_request, renamed
from conveyor.frontend.server.messages_models import (
    MessageObject,
    MessagesRequest,
    MessageUsage,
    TextBlock,
)
from conveyor.frontend.server.messages_stream import MessageEvents
from conveyor.frontend.server.response_models import (
    ChatChoice,
    ChatDelta,
    ChatMessageOut,
    FunctionCallOut,
    FunctionDelta,
    ToolCallDelta,
    ToolCallOut,
)


def _request(**fields: object) -> MessagesRequest:
    return msgspec.convert({"max_tokens": 8, **fields}, MessagesRequest)


def test_thinking_text_and_tool_use_stream_as_the_client_reads_them():
    events = MessageEvents()
    start = MessageObject(id="msg_1", model="m", content=[], usage=MessageUsage(5, 1))
    stream = events.start(start)
    call = [ToolCallDelta(0, "call_1", "function", FunctionDelta("get_weather"))]
    args = [ToolCallDelta(0, function=FunctionDelta(arguments='{"city": ')),
            ToolCallDelta(0, function=FunctionDelta(arguments='"Rome"}'))]  # fmt: skip
    for delta in [ChatDelta("assistant", reasoning="Think"), ChatDelta(reasoning="ing."),
                  ChatDelta(content="Hi"), ChatDelta(tool_calls=call), ChatDelta(tool_calls=args)]:  # fmt: skip
        stream += b"".join(events.chat_delta(delta))
    stream += events.end("tool_use", None, 9)
    names = re.findall(rb"^event: (\S+)$", stream, re.M)
    datas = [json.loads(d) for d in re.findall(rb"^data: (.*)$", stream, re.M)]
    assert [n.decode() for n in names] == [d["type"] for d in datas] == [
        "message_start",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]  # fmt: skip
    snapshot, buffers = None, {}
    for data in datas:
        snapshot = accumulate_event(event=data, current_snapshot=snapshot, json_bufs=buffers)
    thinking, text, use = snapshot.content
    assert (thinking.type, thinking.thinking) == ("thinking", "Thinking.")
    assert (text.type, text.text) == ("text", "Hi")
    assert (use.type, use.id, use.name, use.input) == ("tool_use", "call_1", "get_weather",
                                                       {"city": "Rome"})  # fmt: skip
    assert snapshot.stop_reason == "tool_use" and snapshot.usage.output_tokens == 9


def test_an_empty_stream_has_the_empty_text_block_a_whole_message_has():
    events = MessageEvents()
    stream = events.end("end_turn", None, 1)
    datas = [json.loads(d) for d in re.findall(rb"^data: (.*)$", stream, re.M)]
    assert datas[0] == {"type": "content_block_start", "index": 0,
                        "content_block": {"type": "text", "text": ""}}  # fmt: skip
    assert _blocks(ChatChoice(0, ChatMessageOut("assistant", ""))) == [TextBlock(text="")]
    error = events.error(429, "too many")
    assert error.startswith(b"event: error\n")
    assert json.loads(error.split(b"data: ")[1]) == {
        "type": "error", "error": {"type": "rate_limit_error", "message": "too many"},
    }  # fmt: skip


def test_a_whole_chat_message_becomes_blocks_and_stop_reasons():
    calls = [ToolCallOut("call_2", FunctionCallOut("f", '{"a": 1}'))]
    message = ChatMessageOut("assistant", None, calls, reasoning="Hm.")
    blocks = _blocks(ChatChoice(0, message, finish_reason="tool_calls"))
    assert [b.__struct_config__.tag for b in blocks] == ["thinking", "tool_use"]
    assert blocks[1].input == {"a": 1}
    assert _stop_reason("tool_calls", None) == ("tool_use", None)
    assert _stop_reason("length", None) == ("max_tokens", None)
    assert _stop_reason("stop", "\n\n") == ("stop_sequence", "\n\n")
    assert _stop_reason("stop", None) == ("end_turn", None)
    assert _stop_reason("stop", 151645) == ("end_turn", None)


def test_messages_and_blocks_become_chat_messages():
    body = _request(
        system=[{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Use the tool.", "signature": "x"},
                {"type": "redacted_thinking", "data": "..."},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"city": "Rome"}},
                {"type": "tool_use", "id": "t2", "name": "g", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                {"type": "tool_result", "tool_use_id": "t2",
                 "content": [{"type": "text", "text": "ok"}], "is_error": True},
                {"type": "text", "text": "Thanks", "cache_control": {"type": "ephemeral"}}]},
        ],
        tools=[{"name": "f", "input_schema": {"type": "object"}}, {"name": "g"}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        thinking={"type": "disabled"},
        stop_sequences=["END"],
    )  # fmt: skip
    chat = chat_request(body)
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "be brief"), ("user", "Weather?"), ("assistant", "Checking."),
        ("tool", "sunny"), ("tool", "ok"), ("user", "Thanks"),
    ]  # fmt: skip
    assistant = chat.messages[2]
    assert assistant.reasoning == "Use the tool."
    assert [(c.id, json.loads(c.function.arguments)) for c in assistant.tool_calls] == [
        ("t1", {"city": "Rome"}), ("t2", {}),
    ]  # fmt: skip
    assert [m.tool_call_id for m in chat.messages[3:5]] == ["t1", "t2"]
    assert (chat.tool_choice, chat.parallel_tool_calls) == ("required", False)
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    assert (chat.max_tokens, chat.stop) == (8, ["END"])


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"messages": [{"role": "developer", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
         "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
         "messages[0].content[0]"),
        ({"tools": [{"name": "bash", "type": "bash_20250124"}]}, "tools[0].type"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
        ({"thinking": {"type": "maybe"}}, "thinking"),
        ({"container": "c"}, "container"),
        ({"output_config": {"format": {"type": "xml"}}}, "output_config"),
    ],
)  # fmt: skip
def test_what_cannot_be_rendered_is_named(fields, param):
    body = _request(**{"messages": [{"role": "user", "content": "x"}], **fields})
    with pytest.raises(ApiError) as error:
        chat_request(body)
    assert error.value.param == param


def test_chat_errors_name_the_messages_fields():
    error = renamed(ApiError(400, "too long", "stop"))
    assert (error.param, error.message) == ("stop_sequences", "stop_sequences: too long")
    assert renamed(ApiError(400, "x", "response_format")).param == "output_config.format"
    assert renamed(ApiError(400, "x", "max_tokens")).param == "max_tokens"
