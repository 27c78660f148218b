"""POST /v1/responses through the official ``openai`` client, as its users call it:
``responses.create``, ``responses.stream``, ``responses.parse``, a function tool round trip,
``previous_response_id`` and the stored responses.

One ``conveyor serve --frontends 2`` per module (so a response stored through one frontend must
be found through the other) on the tiny random-weight Qwen3, with the chat template of
test_http_api_surface (it writes tools, tool calls and tool results, and reads
``enable_thinking``) and the hermes tool-call parser. Whatever content matters is forced by a
grammar; greedy text through /v1/responses equals /v1/chat/completions on the same conversation.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.frontend.http_helpers import (
    MODEL_NAME,
    ServedHttp,
    get,
    metric,
    parse_metrics,
    post_json,
    read_events,
    start_served_http,
    wait_for,
)
from tests.frontend.test_http_api_surface import TEMPLATE

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("http-responses")]

HELLO = "hello there"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
GET_WEATHER = {"type": "function", "name": "get_weather"}


class Ticket(BaseModel):
    model_config = ConfigDict(extra="forbid")
    title: str = Field(max_length=12)
    priority: int = Field(ge=1, le=5)


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedHttp]:
    folder = tmp_path_factory.mktemp("responses")
    (folder / "template.jinja").write_text(TEMPLATE)
    extra = ["--frontends", "2", "--chat-template", str(folder / "template.jinja")]
    extra += ["--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
    served = start_served_http(tiny_model_dir, folder / "serve.log", extra)
    try:
        yield served
    finally:
        served.stop()


@pytest.fixture(scope="module")
def client(served: ServedHttp) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0)


def _chat_text(client: openai.OpenAI, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, temperature=0, **kwargs
    )
    return response.choices[0]


def test_greedy_text_equals_chat_whole_and_streamed(client):
    response = client.responses.create(
        model=MODEL_NAME, input=HELLO, instructions="be brief", max_output_tokens=12, temperature=0
    )
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": HELLO}]
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "incomplete" and chat.choices[0].finish_reason == "length"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens == 12
    assert response.usage.total_tokens == chat.usage.total_tokens
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    # The same through the client's stream helper.
    with client.responses.stream(
        model=MODEL_NAME, input=HELLO, instructions="be brief", max_output_tokens=12, temperature=0
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == response.output_text
    assert final.usage.output_tokens == 12 and final.status == "incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1 and kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * deltas,
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == response.output_text == events[-4].text


def test_message_items_and_reasoning_effort_render_as_chat(client):
    items = [
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": HELLO}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hi."}]},
        {"role": "user", "content": "and again"},
    ]
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": HELLO},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "and again"},
    ]
    for effort in ("none", None):
        reasoning = {"effort": effort} if effort else None
        response = client.responses.create(
            model=MODEL_NAME, input=items, max_output_tokens=8, temperature=0, reasoning=reasoning
        )
        chat = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0,
            reasoning_effort=effort,
        )  # fmt: skip
        assert response.output_text == chat.choices[0].message.content
        assert response.usage.input_tokens == chat.usage.prompt_tokens
        assert response.reasoning.effort == effort
    # "none" turns thinking off: the template writes an empty think block, so more tokens.
    assert (
        response.usage.input_tokens
        < client.responses.create(
            model=MODEL_NAME, input=items, max_output_tokens=1, reasoning={"effort": "none"}
        ).usage.input_tokens
    )


def test_a_function_tool_round_trip_whole_streamed_and_by_previous_response_id(client):
    question = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.responses.create(
        model=MODEL_NAME, input=question, tools=TOOLS, tool_choice=GET_WEATHER,
        max_output_tokens=60, temperature=0,
    )  # fmt: skip
    (call,) = first.output
    assert (
        call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    )
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, WEATHER)
    assert call.call_id and call.id.startswith("fc_") and first.status == "completed"
    # The same call through the stream helper: the arguments as deltas, then done.
    with client.responses.stream(
        model=MODEL_NAME, input=question, tools=TOOLS, tool_choice=GET_WEATHER,
        max_output_tokens=60, temperature=0,
    ) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert "response.function_call_arguments.delta" in kinds
    assert kinds[-3:] == [
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    (streamed,) = final.output
    assert (streamed.name, json.loads(streamed.arguments)) == ("get_weather", arguments)
    # The result goes back as a function_call_output; the prompt is chat's for the same turn.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    second = client.responses.create(
        model=MODEL_NAME, input=[*question, *first.output, result], tools=TOOLS,
        tool_choice="none", max_output_tokens=10, temperature=0,
    )  # fmt: skip
    history = [
        *question,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"},
    ]  # fmt: skip
    chat = _chat_text(client, history, max_tokens=10, tools=CHAT_TOOLS, tool_choice="none")
    assert second.output_text == chat.message.content
    # previous_response_id: the stored conversation, then only the new item.
    chained = client.responses.create(
        model=MODEL_NAME, previous_response_id=first.id, input=[result], tools=TOOLS,
        tool_choice="none", max_output_tokens=10, temperature=0,
    )  # fmt: skip
    assert chained.output_text == second.output_text
    assert chained.previous_response_id == first.id
    assert chained.usage.input_tokens == second.usage.input_tokens


def test_auto_tool_choice_reads_the_call_the_model_writes(client):
    written = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    kwargs = dict(model=MODEL_NAME, input="Weather in Rome?", tools=TOOLS, max_output_tokens=80,
                  extra_body={"structured_outputs": {"grammar": "start: " + json.dumps(written)}})  # fmt: skip
    response = client.responses.create(**kwargs)
    assert [item.type for item in response.output] == ["message", "function_call"]
    assert response.output[0].content[0].text == "Checking.\n"
    assert json.loads(response.output[1].arguments) == {"city": "Rome"}
    with client.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.output_text == "Checking.\n"
    assert (final.output[1].name, json.loads(final.output[1].arguments)) == (
        "get_weather",
        {"city": "Rome"},
    )


def test_text_format_json_schema_gives_a_valid_object_whole_and_streamed(client):
    parsed = client.responses.parse(
        model=MODEL_NAME, input="File a ticket", text_format=Ticket, max_output_tokens=100
    )
    assert isinstance(parsed.output_parsed, Ticket)
    jsonschema.validate(json.loads(parsed.output_text), Ticket.model_json_schema())
    with client.responses.stream(
        model=MODEL_NAME, input="File a ticket", text_format=Ticket, max_output_tokens=100,
        temperature=1.0, extra_body={"seed": 3},
    ) as stream:  # fmt: skip
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Ticket)
    json_object = client.responses.create(
        model=MODEL_NAME, input="JSON please", text={"format": {"type": "json_object"}},
        max_output_tokens=60, extra_body={"structured_outputs": None},
    )  # fmt: skip
    assert json_object.status in ("completed", "incomplete")


def test_logprobs_are_the_chat_logprobs(client):
    response = client.responses.create(
        model=MODEL_NAME, input=HELLO, max_output_tokens=4, temperature=0, top_logprobs=2,
        include=["message.output_text.logprobs"],
    )  # fmt: skip
    chat = _chat_text(client, [{"role": "user", "content": HELLO}], max_tokens=4,
                      logprobs=True, top_logprobs=2)  # fmt: skip
    logprobs = response.output[0].content[0].logprobs
    assert [(e.token, e.logprob) for e in logprobs] == [
        (e.token, e.logprob) for e in chat.logprobs.content
    ]
    assert all(len(e.top_logprobs) == 2 for e in logprobs)


def test_stored_responses_are_found_through_every_frontend(client, served):
    response = client.responses.create(model=MODEL_NAME, input=HELLO, max_output_tokens=3)
    assert response.store
    # The frontends share the port at random: eight reads reach both, almost surely.
    for _ in range(8):
        assert client.responses.retrieve(response.id).model_dump() == response.model_dump()
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(response.id)
    deleted = client.responses.delete(response.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(
            model=MODEL_NAME, input=HELLO, max_output_tokens=2, previous_response_id=response.id
        )
    unstored = client.responses.create(
        model=MODEL_NAME, input=HELLO, max_output_tokens=2, store=False
    )
    assert not unstored.store
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    # A streamed response is stored too, once completed.
    with client.responses.stream(model=MODEL_NAME, input=HELLO, max_output_tokens=3) as stream:
        final = stream.get_final_response()
    assert client.responses.retrieve(final.id).output_text == final.output_text


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["x"]}]}, "tools[0].vector_store_ids"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"text": {"verbosity": "low"}}, "text"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"n": 2}, "n"),
        ({"max_output_tokens": 100_000}, "max_output_tokens"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
         "text.format"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0]"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)  # fmt: skip
def test_what_is_not_implemented_is_a_400_naming_it(served, fields, param):
    body = {"model": MODEL_NAME, "input": HELLO, "max_output_tokens": 4, **fields}
    status, _, answer = post_json(served.base_url, "/v1/responses", body)
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer


def test_invocations_serve_an_input_body_as_a_response(served):
    body = {"input": HELLO, "max_output_tokens": 5, "temperature": 0}
    status, _, direct = post_json(served.base_url, "/v1/responses", body)
    status2, _, invoked = post_json(served.base_url, "/invocations", body)
    assert status == status2 == 200
    assert (
        invoked["object"] == "response"
        and invoked["output"][0]["content"][0]["text"]
        == (direct["output"][0]["content"][0]["text"])
    )


def _send(base_url: str, path: str, body: dict[str, Any]) -> socket.socket:
    """POST on a raw socket, left unread: the test decides when to hang up."""
    raw = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", int(base_url.rsplit(":", 1)[1])), timeout=30)
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    return sock


def test_a_disconnect_aborts_the_streamed_response(served):
    def engine() -> tuple[float, float]:
        samples = parse_metrics(get(served.base_url, "/metrics")[1])
        aborted = metric(samples, "conveyor:request_success_total", finished_reason="abort")
        return aborted, metric(samples, "conveyor:num_requests_running")

    before, _ = engine()
    body = {"input": "x", "max_output_tokens": 3000, "ignore_eos": True, "stream": True}
    with _send(served.base_url, "/v1/responses", body) as sock:
        received = read_events(sock, 6)
        assert received.startswith(b"HTTP/1.1 200") and b"event: response.created" in received
    assert wait_for(lambda: engine() == (before + 1, 0), 10.0), engine()
