"""POST /v1/messages and /v1/messages/count_tokens through the official ``anthropic`` client, as
its users call it: ``messages.create``, ``messages.stream``, a tool_use -> tool_result round
trip, ``count_tokens``; Anthropic's error shape, the key as ``x-api-key``, the queue cap and a
disconnect on these routes; metrics and request log lines for them as for chat.

One ``conveyor serve`` per module on the tiny random-weight Qwen3 with an API key (from the
environment), ``--max-queued-requests 2`` and the chat template of test_http_api_surface (it
writes tools, tool calls and results, and reads ``enable_thinking``). Content that matters is
forced by a grammar (a tool's schema, ``output_config.format``); greedy text through
/v1/messages equals /v1/chat/completions on the same conversation.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from tests.frontend.http_helpers import (
    MODEL_NAME,
    ServedHttp,
    get,
    metric,
    parse_metrics,
    post_raw,
    read_events,
    start_served_http,
    wait_for,
)
from tests.frontend.test_http_api_surface import TEMPLATE

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("http-messages")]

API_KEY = "sk-messages-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_IN_FLIGHT = 2
HELLO = [{"role": "user", "content": "hello there"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"name": "get_weather", "description": "The weather", "input_schema": WEATHER}]
CHAT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                      "parameters": WEATHER}}
]  # fmt: skip
GET_WEATHER = {"type": "tool", "name": "get_weather"}
# Newer anthropic clients take no sampling fields as arguments; the API still does.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedHttp]:
    folder = tmp_path_factory.mktemp("messages")
    (folder / "template.jinja").write_text(TEMPLATE)
    extra = ["--chat-template", str(folder / "template.jinja")]
    extra += ["--max-queued-requests", str(MAX_IN_FLIGHT), "--enable-log-requests"]
    env = {"CONVEYOR_API_KEY": API_KEY}
    served = start_served_http(tiny_model_dir, folder / "serve.log", extra, env=env)
    try:
        yield served
    finally:
        served.stop()


@pytest.fixture(scope="module")
def client(served: ServedHttp) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.base_url, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def chat(served: ServedHttp) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url + "/v1", api_key=API_KEY, max_retries=0)


def _chat_choice(chat: openai.OpenAI, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    response = chat.chat.completions.create(
        model=MODEL_NAME, messages=messages, temperature=0, **kwargs
    )
    return response.choices[0], response.usage


def _raw_types(stream: Any) -> list[str]:
    """The wire's event types (the helper adds its own, text and input_json, beside them)."""
    return [e.type for e in stream if e.type not in ("text", "input_json", "thinking")]


def test_greedy_text_equals_chat_whole_and_streamed(client, chat):
    kwargs = dict(model=MODEL_NAME, max_tokens=12, system="be brief", messages=HELLO,
                  extra_body=GREEDY)  # fmt: skip
    message = client.messages.create(**kwargs)
    choice, usage = _chat_choice(
        chat, [{"role": "system", "content": "be brief"}, *HELLO], max_tokens=12
    )
    (block,) = message.content
    assert block.type == "text" and block.text == choice.message.content
    assert message.id.startswith("msg_") and message.role == "assistant"
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    cached = message.usage.cache_read_input_tokens
    assert message.usage.input_tokens + cached == usage.prompt_tokens
    assert message.usage.output_tokens == 12
    # System as text blocks renders the same.
    blocks = client.messages.create(**{**kwargs, "system": [{"type": "text", "text": "be brief"}]})
    assert blocks.content[0].text == block.text
    with client.messages.stream(**kwargs) as stream:
        types = _raw_types(stream)
        final = stream.get_final_message()
    assert final.content[0].text == block.text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 12
    deltas = types.count("content_block_delta")
    assert deltas >= 1 and types == [
        "message_start", "content_block_start", *["content_block_delta"] * deltas,
        "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip


def test_stop_reasons_stop_sequence_and_end_turn(client):
    kwargs = dict(model=MODEL_NAME, max_tokens=16, messages=HELLO, extra_body=GREEDY)
    text = client.messages.create(**kwargs).content[0].text
    stop = next(text[i : i + 2] for i in range(3, len(text)) if text[i : i + 2].strip())
    stopped = client.messages.create(**kwargs, stop_sequences=[stop])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stopped.content[0].text == text[: text.index(stop)]
    with client.messages.stream(**kwargs, stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    assert final.content[0].text == stopped.content[0].text
    # A format the output completes: the model may stop, and does (end_turn).
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    ended = client.messages.create(
        model=MODEL_NAME, max_tokens=40, messages=HELLO,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )  # fmt: skip
    assert ended.stop_reason == "end_turn"
    jsonschema.validate(json.loads(ended.content[0].text), schema)


def test_a_tool_use_round_trip_whole_and_streamed(client, chat):
    question = [{"role": "user", "content": "Weather in Paris?"}]
    kwargs = dict(model=MODEL_NAME, max_tokens=60, messages=question, tools=TOOLS,
                  tool_choice=GET_WEATHER, extra_body=GREEDY)  # fmt: skip
    first = client.messages.create(**kwargs)
    assert first.stop_reason == "tool_use"
    (use,) = first.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER)
    with client.messages.stream(**kwargs) as stream:
        types = _raw_types(stream)
        final = stream.get_final_message()
    assert types[:2] == ["message_start", "content_block_start"]
    assert "content_block_delta" in types and types[-3:] == [
        "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    (streamed,) = final.content
    assert (streamed.type, streamed.name, streamed.input) == ("tool_use", "get_weather", use.input)
    assert final.stop_reason == "tool_use"
    # "any" requires a call of some tool.
    anyone = client.messages.create(**{**kwargs, "tool_choice": {"type": "any"}})
    assert anyone.stop_reason == "tool_use" and anyone.content[-1].type == "tool_use"
    # The result goes back as a tool_result block; the prompt is chat's for the same turn.
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}
    history = [*question, {"role": "assistant", "content": first.content},
               {"role": "user", "content": [result]}]  # fmt: skip
    second = client.messages.create(
        model=MODEL_NAME, max_tokens=10, messages=history, tools=TOOLS,
        tool_choice={"type": "none"}, extra_body=GREEDY,
    )  # fmt: skip
    arguments = json.dumps(use.input)
    chat_history = [
        *question,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": use.id, "type": "function",
             "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "sunny, 21 C"},
    ]  # fmt: skip
    choice, _ = _chat_choice(chat, chat_history, max_tokens=10, tools=CHAT_TOOLS,
                             tool_choice="none")  # fmt: skip
    assert second.content[0].text == choice.message.content
    assert second.stop_reason == "max_tokens"


def test_count_tokens_is_what_create_renders(client):
    kwargs = dict(model=MODEL_NAME, messages=HELLO, system="be brief", tools=TOOLS)
    counted = client.messages.count_tokens(**kwargs, tool_choice=GET_WEATHER)
    created = client.messages.create(**kwargs, tool_choice=GET_WEATHER, max_tokens=30)
    usage = created.usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens
    # Tools are in the prompt unless tool_choice is none; thinking off writes a think block.
    assert client.messages.count_tokens(**kwargs, tool_choice={"type": "none"}).input_tokens < (
        counted.input_tokens
    )
    plain = client.messages.count_tokens(model=MODEL_NAME, messages=HELLO)
    off = client.messages.count_tokens(
        model=MODEL_NAME, messages=HELLO, thinking={"type": "disabled"}
    )
    assert off.input_tokens > plain.input_tokens


def _error(status: int, raw: bytes, error_type: str) -> str:
    assert status >= 400, raw
    body = json.loads(raw)
    assert body["type"] == "error" and set(body) == {"type", "error"}, body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == error_type
    return body["error"]["message"]


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "messages[0].content[0]"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
        ({"stop_sequences": ["x" * 300]}, "stop_sequences"),
        ({"max_tokens": 100_000}, "max_tokens"),
        ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}},
         "output_config.format"),
        ({"tool_choice": {"type": "tool"}, "tools": TOOLS}, "tool_choice"),
        ({"bogus": 1}, "bogus"),
    ],
)  # fmt: skip
def test_errors_take_anthropics_shape_and_name_the_field(served, fields, expected):
    body = {"model": MODEL_NAME, "max_tokens": 4, "messages": HELLO, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    status, _, raw = post_raw(served.base_url, "/v1/messages", json.dumps(body).encode(), AUTH)
    assert status == 400
    assert expected in _error(status, raw, "invalid_request_error")


def test_the_clients_errors_and_the_key_as_x_api_key(client, served):
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-x", max_tokens=4, messages=HELLO)
    body = json.dumps({"max_tokens": 4, "messages": HELLO}).encode()
    for headers in ({}, {"x-api-key": "sk-wrong"}, {"Authorization": "Bearer sk-wrong"}):
        status, _, raw = post_raw(served.base_url, "/v1/messages", body, headers)
        assert status == 401 and "x-api-key" in _error(status, raw, "authentication_error")
    for headers in ({"x-api-key": API_KEY}, AUTH):
        assert post_raw(served.base_url, "/v1/messages", body, headers)[0] == 200
    bearer = anthropic.Anthropic(base_url=served.base_url, auth_token=API_KEY, max_retries=0)
    assert bearer.messages.count_tokens(model=MODEL_NAME, messages=HELLO).input_tokens > 0
    # Only Anthropic's routes take x-api-key; the others keep OpenAI's error shape.
    chat = json.dumps({"messages": HELLO, "max_tokens": 2}).encode()
    status, _, raw = post_raw(served.base_url, "/v1/chat/completions", chat, {"x-api-key": API_KEY})
    assert status == 401 and json.loads(raw)["error"]["code"] == 401


def _send(base_url: str, body: dict[str, Any]) -> socket.socket:
    raw = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", int(base_url.rsplit(":", 1)[1])), timeout=30)
    head = "POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += f"x-api-key: {API_KEY}\r\nContent-Length: {len(raw)}\r\n\r\n"
    sock.sendall(head.encode() + raw)
    return sock


# A string the grammar keeps open past max_tokens: EOS cannot end these streams early.
OPEN_STRING = {"type": "json_schema", "schema": {"type": "string", "minLength": 20_000}}
LONG = {"max_tokens": 3000, "messages": [{"role": "user", "content": "x"}], "stream": True,
        "output_config": {"format": OPEN_STRING}}  # fmt: skip


def test_the_queue_cap_holds_and_a_disconnect_aborts(served):
    def engine() -> tuple[float, float]:
        samples = parse_metrics(get(served.base_url, "/metrics")[1])
        aborted = metric(samples, "conveyor:request_success_total", finished_reason="abort")
        return aborted, metric(samples, "conveyor:num_requests_running")

    before, _ = engine()
    streams = [_send(served.base_url, LONG) for _ in range(MAX_IN_FLIGHT)]
    try:
        for sock in streams:
            received = read_events(sock, 3)
            assert received.startswith(b"HTTP/1.1 200") and b"event: message_start" in received
        status, headers, raw = post_raw(
            served.base_url, "/v1/messages", json.dumps(LONG).encode(), AUTH
        )
        _error(status, raw, "rate_limit_error")
        assert status == 429 and int(headers["retry-after"]) >= 1
    finally:
        for sock in streams:
            sock.close()
    assert wait_for(lambda: engine() == (before + MAX_IN_FLIGHT, 0), 10.0), engine()


def test_metrics_and_request_logs_count_the_new_routes(served):
    def counts() -> tuple[float, float, int, int]:
        samples = parse_metrics(get(served.base_url, "/metrics")[1])
        log = served.log.read_text()
        return (
            metric(samples, "conveyor:request_success_total"),
            metric(samples, "conveyor:generation_tokens_total"),
            len(re.findall(r"requests: request \S+: 1 prompt\(s\) of", log)),
            len(re.findall(r"requests: request \S+ finished: length, 3 tokens", log)),
        )

    before = counts()
    bodies = (
        ("/v1/messages", {"max_tokens": 3, "messages": HELLO}),
        ("/v1/responses", {"max_output_tokens": 3, "input": "hello there"}),
        ("/invocations", {"max_tokens": 3, "messages": HELLO}),
        ("/invocations", {"max_output_tokens": 3, "input": "hello there"}),
    )
    for path, body in bodies:
        status, _, raw = post_raw(served.base_url, path, json.dumps(body).encode(), AUTH)
        assert status == 200, (path, raw[:300])
    expected = (before[0] + 4, before[1] + 12, before[2] + 4, before[3] + 4)
    assert wait_for(lambda: counts() == expected, 10.0), (counts(), expected)
