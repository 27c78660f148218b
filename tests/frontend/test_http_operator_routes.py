"""The routes operators and platforms call: SageMaker's /ping and /invocations, vLLM's /load and
/tokenizer_info, OpenAI's GET /v1/models/{model}, /openapi.json (checked against the request
models the routes decode) and /docs, and a 404 that names the routes there are.

One ``conveyor serve`` per module with an API key (from the environment), so every test also
shows which routes need it: the probes (/ping, /load) do not.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import msgspec
import openai
import pytest

from conveyor.frontend.server import messages_models, request_models, responses_models, tokenize
from conveyor.frontend.server.app import API_ROUTES, ServerSettings, build_app
from conveyor.frontend.server.openapi import shown_path
from conveyor.frontend.server.request_models import StrictStruct
from conveyor.frontend.tokenizer import load_tokenizer
from tests.frontend.http_helpers import (
    MODEL_NAME,
    ServedHttp,
    get,
    post_json,
    post_raw,
    read_events,
    send_completion,
    start_served_http,
    stream_payloads,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("http-operator-routes")]

API_KEY = "sk-operator-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "temperature": 0}
COMPLETION = {"prompt": "def main():", "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedHttp]:
    log = tmp_path_factory.mktemp("operator") / "serve.log"
    served = start_served_http(tiny_model_dir, log, [], env={"CONVEYOR_API_KEY": API_KEY})
    try:
        yield served
    finally:
        served.stop()


@pytest.fixture(scope="module")
def client(served: ServedHttp) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url + "/v1", api_key=API_KEY, max_retries=0)


def test_ping_answers_as_health_without_a_key(served):
    assert get(served.base_url, "/ping") == get(served.base_url, "/health")
    assert json.loads(get(served.base_url, "/ping")[1]) == {"status": "ok"}
    status, _, body = post_json(served.base_url, "/ping", {})
    assert (status, body) == (200, {"status": "ok"})


def test_invocations_serve_each_body_as_its_own_route_would(served):
    for body, path in [(CHAT, "/v1/chat/completions"), (COMPLETION, "/v1/completions")]:
        status, _, direct = post_json(served.base_url, path, body, AUTH)
        assert status == 200, direct
        status, _, invoked = post_json(served.base_url, "/invocations", body, AUTH)
        assert status == 200, invoked
        assert invoked["object"] == direct["object"] and invoked["choices"] == direct["choices"]
    # Streamed, as a chat.
    status, headers, raw = post_raw(
        served.base_url, "/invocations", json.dumps({**CHAT, "stream": True}).encode(), AUTH
    )
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    chunks = stream_payloads(raw)
    assert chunks[0]["object"] == "chat.completion.chunk" and raw.endswith(b"data: [DONE]\n\n")
    # A body of none of the shapes, and one without the key.
    status, _, body = post_json(served.base_url, "/invocations", {"max_tokens": 3}, AUTH)
    assert status == 400 and "messages, prompt" in body["error"]["message"]
    status, _, body = post_json(served.base_url, "/invocations", COMPLETION)
    assert status == 401
    # Each shape is checked as its route checks it: an unknown field is named.
    status, _, body = post_json(served.base_url, "/invocations", {**CHAT, "bogus": 1}, AUTH)
    assert (status, body["error"]["param"]) == (400, "bogus")


def test_a_model_is_retrieved_by_its_name(client):
    model = client.models.retrieve(MODEL_NAME)
    assert model.id == MODEL_NAME and model.object == "model"
    assert model.model_dump()["max_model_len"] > 0
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("org/other-model")


def test_tokenizer_info_is_the_tokenizers_configuration(served, tiny_model_dir):
    assert get(served.base_url, "/tokenizer_info")[0] == 401
    status, text = get(served.base_url, "/tokenizer_info", AUTH)
    assert status == 200, text
    info = json.loads(text)
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert info["chat_template"] == config["chat_template"]
    assert info["tokenizer_class"] == type(load_tokenizer(tiny_model_dir)).__name__
    assert info["eos_token"] == config["eos_token"]
    assert not [key for key in info if key.endswith("_file")]


def test_load_counts_the_generation_requests_in_flight(served):
    assert json.loads(get(served.base_url, "/load")[1]) == {"server_load": 0}
    body = {"prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    sock = send_completion(served.base_url, body, AUTH)
    try:
        read_events(sock, 2)
        assert json.loads(get(served.base_url, "/load")[1]) == {"server_load": 1}
    finally:
        sock.close()
    idle = wait_for(lambda: json.loads(get(served.base_url, "/load")[1])["server_load"] == 0, 10)
    assert idle


def test_an_unknown_route_is_a_404_naming_every_route(served):
    status, text = get(served.base_url, "/v1/chat/completion", AUTH)
    assert status == 404
    message = json.loads(text)["error"]["message"]
    assert message.startswith("no route GET /v1/chat/completion; this server answers:")
    for route in API_ROUTES:
        assert f" {shown_path(route.path)}" in message, route.path
    assert "POST /v1/chat/completions" in message and "GET|POST /ping" in message
    # The echoed path is cut: a long one cannot bloat the answer.
    status, text = get(served.base_url, "/" + "x" * 5000, AUTH)
    assert status == 404 and len(text) < 4096
    # A known route with another method is a 405, not a 404.
    status, _, _ = post_json(served.base_url, "/v1/models", {}, AUTH)
    assert status == 405


def _strict_models() -> dict[str, type]:
    """Every request model (and part of one) the server's modules define, by name."""
    modules = (request_models, responses_models, messages_models, tokenize)
    return {
        obj.__name__: obj
        for module in modules
        for obj in vars(module).values()
        if isinstance(obj, type) and issubclass(obj, StrictStruct) and obj is not StrictStruct
    }


def test_openapi_lists_every_route_and_every_field_the_server_accepts(served):
    status, text = get(served.base_url, "/openapi.json")  # no key: it describes, nothing more
    assert status == 200
    spec = json.loads(text)
    assert spec["openapi"].startswith("3.1")
    app_routes = build_app(ServerSettings(("ipc://unused",))).routes
    served_routes = {
        (shown_path(route.path), method.lower())
        for route in app_routes
        for method in route.methods - {"HEAD"}
    }
    assert {(path, method) for path, ops in spec["paths"].items() for method in ops} == (
        served_routes
    )
    # Every field of every request model, nested ones included, and none more.
    schemas = spec["components"]["schemas"]
    models = _strict_models()
    for name, model in models.items():
        if name in schemas:
            fields = {field.encode_name for field in msgspec.structs.fields(model)}
            assert set(schemas[name]["properties"]) == fields, name
            assert schemas[name]["additionalProperties"] is False, name
    bodies = {t.__name__ for route in API_ROUTES for t in route.body_types}
    assert {name for name in models if name.endswith("Request")} <= bodies
    # Each route decodes the model it lists: a field outside it is refused by name.
    for route in API_ROUTES:
        if route.body is None or route.path == "/invocations":
            continue
        body = json.dumps({"not_a_field": 1}).encode()
        status, _, raw = post_raw(served.base_url, route.path, body, AUTH)
        assert status == 400 and b"not_a_field" in raw, (route.path, raw)
    operation = spec["paths"]["/v1/responses"]["post"]
    assert operation["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ResponsesRequest"
    }
    invocations = spec["paths"]["/invocations"]["post"]["requestBody"]["content"]
    assert len(invocations["application/json"]["schema"]["oneOf"]) == 3


def test_docs_is_a_page_of_every_route_and_model(served):
    status, page = get(served.base_url, "/docs")
    assert status == 200 and page.startswith("<!doctype html>")
    for route in API_ROUTES:
        assert f"<code>{shown_path(route.path)}</code>" in page, route.path
    assert '<h3 id="MessagesRequest">' in page and "<code>max_output_tokens</code>" in page
    assert "<script" not in page  # nothing loaded from anywhere else
