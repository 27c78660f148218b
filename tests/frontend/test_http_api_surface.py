"""The strict API surface: every request field implemented or a 400 naming it; the model's own
sampling defaults; a chat template and its variables; /tokenize, /detokenize and /version;
structured outputs and tool calling through the official ``openai`` client.

One ``conveyor serve`` per module on the tiny Qwen3, started with ``--generation-config DIR``
(a folder whose generation_config.json says temperature 0 and max_new_tokens 7),
``--chat-template FILE`` (a template that reads ``enable_thinking`` and writes tools and tool
calls, as Qwen3's does), ``--tool-call-parser hermes --enable-auto-tool-choice`` and
``--disable-metrics`` (so every request here also runs without metrics). Greedy outputs are
compared with ``LLM`` on the same prompts, and templates with ``transformers``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from conveyor.frontend import LLM
from conveyor.frontend.tokenizer import load_tokenizer
from conveyor.protocol import SamplingParams
from tests.frontend.http_helpers import (
    MODEL_NAME,
    ServedHttp,
    get,
    post_json,
    post_raw,
    start_served_http,
    stream_payloads,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("http-api-surface")]

PROMPT = "def main():\n    "
CHAT = [{"role": "user", "content": "hello there"}]
DEFAULT_MAX_TOKENS = 7
TEMPLATE = """\
{%- if tools %}<|im_start|>system
# Tools
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedHttp]:
    folder = tmp_path_factory.mktemp("surface")
    defaults = folder / "generation"
    defaults.mkdir()
    (defaults / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": DEFAULT_MAX_TOKENS})
    )
    (folder / "template.jinja").write_text(TEMPLATE)
    extra = ["--frontends", "1", "--generation-config", str(defaults)]
    extra += ["--chat-template", str(folder / "template.jinja"), "--tool-call-parser", "hermes"]
    extra += ["--enable-auto-tool-choice", "--disable-metrics"]
    served = start_served_http(tiny_model_dir, folder / "serve.log", extra)
    try:
        yield served
    finally:
        served.stop()


@pytest.fixture(scope="module")
def client(served: ServedHttp) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def greedy(tiny_model_dir: Path, tokenizer: Any) -> dict[str, Any]:
    """``LLM``'s greedy outputs for the prompts below (its own defaults: no generation config)."""
    ids = list(tokenizer(PROMPT).input_ids)
    with LLM(str(tiny_model_dir), engine="inprocess", kv_cache_memory=16 << 20) as llm:
        params = SamplingParams(temperature=0, max_tokens=DEFAULT_MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([ids, ids[-3:]], params, use_tqdm=False)
    return {"whole": outputs[0].outputs[0], "last3": outputs[1].outputs[0]}


def _refused(served: ServedHttp, path: str, body: dict[str, Any], param: str) -> str:
    status, _, answer = post_json(served.base_url, path, body)
    assert status == 400, (path, body, answer)
    assert answer["error"]["param"] == param, answer
    return answer["error"]["message"]


def test_disabled_metrics_answer_404_and_leave_no_metrics_folder(served):
    status, body = get(served.base_url, "/metrics")
    assert status == 404 and "--disable-metrics" in json.loads(body)["error"]["message"]
    runtime = Path(re.sub(r"^ipc://", "", served.engine_address)).parent
    assert not (runtime / "metrics").exists()


def test_a_field_the_server_does_not_know_is_a_400_naming_it(served):
    completion = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2}
    chat = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 2}
    cases = [
        ("/v1/completions", {**completion, "frobnicate": 1}, "frobnicate"),
        ("/v1/chat/completions", {**chat, "verbosity": "low"}, "verbosity"),
        ("/v1/completions", {**completion, "structured_outputs": {"regexp": "a+"}},
         "structured_outputs.regexp"),
        ("/v1/chat/completions", {**chat, "tool_choice": "auto"}, "tool_choice"),
        ("/v1/chat/completions", {**chat, "tools": [{"type": "function"}]}, "tools[0]"),
        ("/v1/chat/completions",
         {**chat, "response_format": {"type": "json_schema", "json_schema": {"schma": {}}}},
         "response_format.json_schema.schma"),
        ("/v1/chat/completions",
         {**chat, "messages": [{"role": "assistant", "content": "", "function_call": {}}]},
         "messages[0].function_call"),
        ("/v1/chat/completions",
         {**chat, "stream": True, "stream_options": {"include_cost": True}},
         "stream_options.include_cost"),
    ]  # fmt: skip
    for path, body, param in cases:
        message = _refused(served, path, body, param)
        assert param.split(".")[-1].split("[")[0] in message
    # Fields of features this server lacks: a 400 naming each, unless they ask for nothing.
    refused = {"use_beam_search": True, "bad_words": ["x"], "logprob_token_ids": [1],
               "thinking_token_budget": 5, "repetition_detection": {}, "vllm_xargs": {"a": 1},
               "kv_transfer_params": {}, "ec_transfer_params": {}, "watermarking": True}  # fmt: skip
    chat_refused = {"chat_template": "{{ messages }}", "mm_processor_kwargs": {"a": 1},
                    "media_io_kwargs": {"image": {}}, "modalities": ["text", "audio"]}  # fmt: skip
    for path, base, fields in (
        ("/v1/completions", completion, {**refused, "prompt_embeds": "AAAA"}),
        ("/v1/chat/completions", chat, {**refused, **chat_refused}),
    ):
        for name, value in fields.items():
            assert name in _refused(served, path, {**base, name: value}, name)


def test_the_generation_config_fills_what_a_request_leaves_out(client, greedy):
    """temperature 0 and max_new_tokens 7 from the folder; the request's own values win."""
    expected = greedy["whole"]
    plain = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, extra_body={"ignore_eos": True}
    )
    assert plain.usage.completion_tokens == DEFAULT_MAX_TOKENS
    assert plain.choices[0].text == expected.text, "the default temperature is the file's 0"
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, extra_body={"ignore_eos": True}
    )
    assert chat.usage.completion_tokens == DEFAULT_MAX_TOKENS
    short = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3)
    assert short.usage.completion_tokens == 3
    sampled = {
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, temperature=1.5, seed=seed,
            extra_body={"ignore_eos": True},
        ).choices[0].text
        for seed in range(4)
    }  # fmt: skip
    assert sampled - {expected.text}, "an explicit temperature samples"


def test_logit_bias_and_allowed_token_ids_reach_the_sampler(client, served, tokenizer):
    favourite = 123
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 5, "logprobs": 0,
            "logit_bias": {str(favourite): 100}, "ignore_eos": True}  # fmt: skip
    status, _, answer = post_json(served.base_url, "/v1/completions", body)
    assert status == 200, answer
    tokens = answer["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 5 and len(set(tokens)) == 1
    assert tokens == [tokenizer.decode([favourite])] * 5, "the token the bias pushed"
    # Sampled, but only one token is allowed: the same token as the bias pushed, 8 times.
    allowed = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0,
               "seed": 3, "allowed_token_ids": [favourite], "ignore_eos": True, "logprobs": 0}  # fmt: skip
    status, _, only = post_json(served.base_url, "/v1/completions", allowed)
    assert status == 200 and only["choices"][0]["logprobs"]["tokens"] == [tokens[0]] * 8
    for bad, param in (
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"allowed_token_ids": [999999]}, "allowed_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
    ):
        _refused(served, "/v1/completions", {"prompt": PROMPT, **bad}, param)


def test_truncate_prompt_tokens_keeps_the_prompts_end(client, greedy, served):
    expected = greedy["last3"]
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT * 400, max_tokens=DEFAULT_MAX_TOKENS, temperature=0,
        extra_body={"truncate_prompt_tokens": 3, "ignore_eos": True},
    )  # fmt: skip
    assert response.usage.prompt_tokens == 3
    short = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=DEFAULT_MAX_TOKENS, temperature=0,
        extra_body={"truncate_prompt_tokens": 3, "ignore_eos": True},
    )  # fmt: skip
    assert short.choices[0].text == expected.text
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=2, extra_body={"truncate_prompt_tokens": 4}
    )
    assert chat.usage.prompt_tokens == 4
    _refused(served, "/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": 0},
             "truncate_prompt_tokens")  # fmt: skip


def test_echo_puts_the_prompt_before_the_completion(client, greedy):
    whole = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, echo=True, extra_body={"ignore_eos": True}
    )
    assert whole.choices[0].text == PROMPT + greedy["whole"].text
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt=[PROMPT, "x"], n=2, echo=True, stream=True,
            extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    texts = ["", "", "", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts[:2] == [PROMPT + greedy["whole"].text] * 2
    assert all(t.startswith("x") for t in texts[2:])


def test_chat_template_file_and_its_variables(client, served, tokenizer):
    def rendered(**kwargs: Any) -> list[int]:
        text = tokenizer.apply_chat_template(
            CHAT, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=False, **kwargs
        )
        return list(tokenizer(text, add_special_tokens=False).input_ids)

    status, _, default = post_json(served.base_url, "/tokenize", {"messages": CHAT})
    assert status == 200 and default["tokens"] == rendered()
    body = {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    _, _, off = post_json(served.base_url, "/tokenize", body)
    assert off["tokens"] == rendered(enable_thinking=False) != default["tokens"]
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    assert chat.usage.prompt_tokens == off["count"]
    no_prompt = {"messages": CHAT, "add_generation_prompt": False}
    _, _, bare = post_json(served.base_url, "/tokenize", no_prompt)
    assert bare["tokens"] == default["tokens"][: bare["count"]] and bare["count"] < default["count"]
    _refused(served, "/v1/chat/completions",
             {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}},
             "chat_template_kwargs")  # fmt: skip


def test_tokenize_detokenize_and_version(served, tokenizer):
    status, _, answer = post_json(served.base_url, "/tokenize", {"prompt": PROMPT})
    expected = list(tokenizer(PROMPT).input_ids)
    assert status == 200 and answer["tokens"] == expected and answer["count"] == len(expected)
    assert answer["max_model_len"] > 0 and answer["token_strs"] is None
    _, _, strs = post_json(
        served.base_url, "/tokenize", {"prompt": PROMPT, "return_token_strs": True}
    )
    assert strs["token_strs"] == tokenizer.convert_ids_to_tokens(expected)
    status, _, text = post_json(served.base_url, "/detokenize", {"tokens": expected})
    assert status == 200 and text["prompt"] == tokenizer.decode(expected)
    _refused(served, "/detokenize", {"tokens": [10**9]}, "tokens")
    _refused(served, "/tokenize", {"prompt": "a", "messages": CHAT}, "prompt")
    _refused(served, "/tokenize", {"prompt": "a", "frobnicate": 1}, "frobnicate")
    for chat_only in ({"add_generation_prompt": False}, {"tools": TOOLS},
                      {"chat_template_kwargs": {}}):  # fmt: skip
        (name,) = chat_only
        assert "needs messages" in _refused(served, "/tokenize", {"prompt": "a", **chat_only}, name)
    status, version = get(served.base_url, "/version")
    assert status == 200 and json.loads(version)["version"] not in ("", "unknown")


def test_streamed_min_tokens_holds_the_stop_token(served):
    """min_tokens with a stop token pushed to the top, through HTTP and streamed."""
    stop = 99
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 10, "min_tokens": 4,
            "stop_token_ids": [stop], "logit_bias": {str(stop): 100}, "stream": True,
            "include_stop_str_in_output": True, "logprobs": 0}  # fmt: skip
    status, _, raw = post_raw(served.base_url, "/v1/completions", json.dumps(body).encode())
    assert status == 200
    payloads = stream_payloads(raw)
    finish = [c["finish_reason"] for p in payloads for c in p["choices"] if c["finish_reason"]]
    tokens = [t for p in payloads for c in p["choices"] if c["logprobs"]
              for t in c["logprobs"]["tokens"]]  # fmt: skip
    assert finish == ["stop"] and len(tokens) == 5, tokens


class Owner(BaseModel):
    name: str = Field(max_length=8)
    admin: bool


class Ticket(BaseModel):
    """Nested object, array of enums, optional fields, a pattern, a union."""

    id: str = Field(pattern=r"^[A-Z]{2}[0-9]{2}$")
    owner: Owner
    colour: Literal["red", "green", "blue"]
    tags: list[Literal["a", "b"]] = Field(max_length=3)
    priority: int | None = Field(default=None, ge=0, le=9)
    model_config = ConfigDict(extra="forbid")


def test_parse_with_a_pydantic_model_whole_and_streamed_greedy_and_sampled(client):
    """``chat.completions.parse`` and a streamed ``response_format``: every choice is valid."""
    schema = Ticket.model_json_schema()
    for kwargs in ({"temperature": 0}, {"temperature": 1.0, "seed": 4, "n": 3}):
        completion = client.chat.completions.parse(
            model=MODEL_NAME, messages=CHAT, response_format=Ticket, max_tokens=256, **kwargs
        )
        assert len(completion.choices) == kwargs.get("n", 1)
        for choice in completion.choices:
            assert choice.finish_reason == "stop"
            assert isinstance(choice.message.parsed, Ticket)
            jsonschema.validate(json.loads(choice.message.content), schema)
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=256, temperature=1.0, seed=9, n=3,
        stream=True,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "ticket", "schema": schema, "strict": True}},
    )  # fmt: skip
    texts = ["", "", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    for text in texts:
        Ticket.model_validate_json(text)
    json_object = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=24, temperature=0,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert json_object.choices[0].message.content.startswith("{")


def test_structured_outputs_on_completions_and_invalid_constraints(served):
    for constraint, check in (
        ({"regex": "[a-c]{2}-[0-9]"}, lambda t: re.fullmatch("[a-c]{2}-[0-9]", t)),
        ({"choice": ["left", "right"]}, lambda t: t in ("left", "right")),
        ({"json": {"type": "object", "properties": {"k": {"enum": [1, 2]}},
                   "required": ["k"], "additionalProperties": False}},
         lambda t: json.loads(t)["k"] in (1, 2)),
        ({"grammar": 'start: "ok" | "fine"'}, lambda t: t in ("ok", "fine")),
    ):  # fmt: skip
        body = {"prompt": PROMPT, "max_tokens": 64, "temperature": 1.0, "seed": 1, "n": 2,
                "structured_outputs": constraint}  # fmt: skip
        status, _, answer = post_json(served.base_url, "/v1/completions", body)
        assert status == 200, answer
        for choice in answer["choices"]:
            assert check(choice["text"]) and choice["finish_reason"] == "stop", choice
    chat = {"messages": CHAT, "max_tokens": 8}
    for path, body, param, problem in (
        ("/v1/completions", {"prompt": PROMPT, "structured_outputs": {"regex": "a(b"}},
         "structured_outputs", "unclosed group"),
        ("/v1/completions", {"prompt": PROMPT, "structured_outputs": {"regex": "a", "choice": ["a"]}},
         "structured_outputs", "exactly one"),
        ("/v1/chat/completions",
         {**chat, "response_format": {"type": "json_schema",
                                      "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format", "nope"),
        ("/v1/chat/completions", {**chat, "response_format": {"type": "yaml"}},
         "response_format", "yaml"),
        ("/v1/chat/completions", {**chat, "response_format": {"type": "json_object"},
                                  "structured_outputs": {"regex": "a"}},
         "structured_outputs", "not both"),
    ):  # fmt: skip
        start = time.perf_counter()
        assert problem in _refused(served, path, body, param)
        assert time.perf_counter() - start < 1.0


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
HISTORY = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather",
                                  "arguments": '{"city": "Paris", "unit": "C"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
]  # fmt: skip


def test_tool_history_renders_exactly_as_transformers_renders_it(served, tokenizer):
    text = tokenizer.apply_chat_template(
        HISTORY, tools=TOOLS, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    assert "<tool_call>" in text and "18 degrees" in text and "get_time" in text
    expected = list(tokenizer(text, add_special_tokens=False).input_ids)
    status, _, answer = post_json(
        served.base_url, "/tokenize", {"messages": HISTORY, "tools": TOOLS}
    )
    assert status == 200 and answer["tokens"] == expected
    # What the openai client sends for a tool-call message: content null. Rendered as "".
    with_null = [*HISTORY[:2], {**HISTORY[2], "content": None}, HISTORY[3]]
    _, _, nulled = post_json(served.base_url, "/tokenize", {"messages": with_null, "tools": TOOLS})
    assert nulled["tokens"] == expected
    chat = {"messages": HISTORY, "tools": TOOLS, "tool_choice": "none", "max_tokens": 1}
    status, _, answer = post_json(served.base_url, "/v1/chat/completions", chat)
    assert status == 200, answer
    # tool_choice none: no tool definitions in the prompt (vLLM's default).
    _, _, bare = post_json(served.base_url, "/tokenize", {"messages": HISTORY})
    assert answer["usage"]["prompt_tokens"] == bare["count"] < len(expected)


def _check_calls(calls: list[Any], names: set[str]) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def _streamed_calls(stream: Any) -> tuple[dict[int, dict[int, dict[str, str]]], dict[int, str]]:
    """Per choice, per call index: id, name and the joined arguments; per choice its finish."""
    calls: dict[int, dict[int, dict[str, str]]] = {}
    finish: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(choice.index, {}).setdefault(
                    delta.index, {"id": "", "name": "", "arguments": ""}
                )
                call["id"] = delta.id or call["id"]
                call["name"] += (delta.function.name or "") if delta.function else ""
                call["arguments"] += (delta.function.arguments or "") if delta.function else ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return calls, finish


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_required_and_named_tool_choice_always_give_a_valid_call(client, tool_choice):
    names = {"get_weather"} if isinstance(tool_choice, dict) else set(PARAMETERS)
    kwargs = dict(model=MODEL_NAME, messages=CHAT, tools=TOOLS, tool_choice=tool_choice,
                  parallel_tool_calls=False, max_tokens=200)  # fmt: skip
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 2, "n": 3}):
        response = client.chat.completions.create(**kwargs, **sampling)
        for choice in response.choices:
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content is None
            _check_calls(choice.message.tool_calls, names)
            assert len(choice.message.tool_calls) == 1
    stream = client.chat.completions.create(**kwargs, temperature=1.0, seed=5, n=2, stream=True)
    calls, finish = _streamed_calls(stream)
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    for per_choice in calls.values():
        (call,) = per_choice.values()
        assert call["id"].startswith("call_") and call["name"] in names
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])


def test_auto_reads_the_calls_a_model_writes_in_its_format(client):
    """The hermes parser on what a model forced by a grammar writes: a sentence, then a call."""
    written = (
        'Checking.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    )
    grammar = "start: " + json.dumps(written)
    kwargs = dict(model=MODEL_NAME, messages=CHAT, tools=TOOLS, max_tokens=100,
                  extra_body={"structured_outputs": {"grammar": grammar}})  # fmt: skip
    response = client.chat.completions.create(**kwargs)
    (choice,) = response.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking.\n"
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_time",
        {"zone": "CET"},
    )
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls, finish = _streamed_calls(iter(chunks))
    assert content == "Checking.\n" and finish == {0: "tool_calls"}
    assert [(c["name"], json.loads(c["arguments"])) for c in calls[0].values()] == [
        ("get_time", {"zone": "CET"})
    ]
    # Two calls written, parallel_tool_calls false: the first is kept, whole and streamed.
    second = '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}\n</tool_call>'
    twice = {
        **kwargs,
        "extra_body": {"structured_outputs": {"grammar": "start: " + json.dumps(written + second)}},
    }
    both = client.chat.completions.create(**twice)
    assert [c.function.name for c in both.choices[0].message.tool_calls] == [
        "get_time",
        "get_weather",
    ]
    one = client.chat.completions.create(**twice, parallel_tool_calls=False)
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["get_time"]
    calls, _ = _streamed_calls(
        client.chat.completions.create(**twice, parallel_tool_calls=False, stream=True)
    )
    assert [c["name"] for c in calls[0].values()] == ["get_time"]
    # No call written: all content, the usual finish.
    plain = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, tools=TOOLS, max_tokens=5, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason == "length" and plain.choices[0].message.content


def test_tool_fields_that_do_not_fit_are_refused(served):
    chat = {"messages": CHAT, "max_tokens": 2}
    for body, param, problem in (
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"parallel_tool_calls": True}, "parallel_tool_calls", "needs tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "nope"),
        ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools", "distinct"),
        ({"tools": [{**WEATHER_TOOL, "type": "custom"}]}, "tools[0].type", "function"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice", "already constrains"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
          "tool_choice": "required"}, "tools", "nope"),
    ):  # fmt: skip
        assert problem in _refused(served, "/v1/chat/completions", {**chat, **body}, param)


def test_nesting_past_the_parsers_is_a_400_or_content_never_a_5xx(served):
    """A schema's JSON text 5,000 levels deep, and a tool call a regex forces 1,100 arrays
    deep (tool_choice auto and a constraint go together): Python's JSON parser gives up on both
    with a RecursionError, which was a 500 and a stream's error event blaming the engine."""
    log_start = served.log.stat().st_size
    deep_schema = '{"type": "array", "items": ' * 5000 + "{}" + "}" * 5000
    body = {"messages": CHAT, "structured_outputs": {"json": deep_schema}}
    status, _, answer = post_json(served.base_url, "/v1/chat/completions", body)
    assert (status, answer["error"]["param"]) == (400, "structured_outputs"), answer
    assert "nested too deeply" in answer["error"]["message"]
    # The same schema as an object: the body itself is too deep to decode.
    for field, end in ((b'"structured_outputs": {"json": ', b"}}"),
                       (b'"response_format": {"type": "json_schema", "json_schema": '
                        b'{"name": "x", "schema": ', b"}}}")):  # fmt: skip
        raw_body = b'{"messages": [], ' + field + deep_schema.encode() + end
        status, _, raw = post_raw(served.base_url, "/v1/chat/completions", raw_body)
        assert status == 400 and b"nested too deeply" in raw, raw
    text = '<tool_call>{"name": "get_time", "arguments": {"zone": ' + "[" * 1100 + "]" * 1100
    text += "}}</tool_call>"
    body = {"messages": CHAT, "tools": TOOLS, "tool_choice": "auto", "max_tokens": len(text),
            "structured_outputs": {"regex": re.escape(text)}}  # fmt: skip
    with ThreadPoolExecutor(2) as pool:  # the two decode side by side: half the time
        whole = pool.submit(post_json, served.base_url, "/v1/chat/completions", body)
        streamed = pool.submit(post_raw, served.base_url, "/v1/chat/completions",
                               json.dumps({**body, "stream": True}).encode())  # fmt: skip
        (status, _, answer), (stream_status, _, raw) = whole.result(), streamed.result()
    assert status == 200, answer
    (choice,) = answer["choices"]
    assert choice["message"]["content"] == text and choice["message"].get("tool_calls") is None
    assert choice["finish_reason"] == "stop"
    events = stream_payloads(raw)
    assert stream_status == 200 and not [e for e in events if "error" in e]
    deltas = [c["delta"] for e in events for c in e["choices"]]
    # Streamed, the call's name and arguments went out as written, before its end showed it
    # too deep to read: never an error, and none of it is content.
    calls = [call for d in deltas for call in d.get("tool_calls") or []]
    assert [c["function"]["name"] for c in calls if "name" in c["function"]] == ["get_time"]
    assert not "".join(d.get("content") or "" for d in deltas)
    with served.log.open() as log:
        log.seek(log_start)
        assert "Traceback" not in log.read()


# ---------------------------------------------------------------- vLLM's and OpenAI's other fields


def _streamed(served: ServedHttp, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    status, _, raw = post_raw(served.base_url, path, json.dumps({**body, "stream": True}).encode())
    assert status == 200, raw
    return stream_payloads(raw)


# Bookkeeping (OpenAI's and gateways'), and vLLM's fields at the value that asks for nothing.
BOOKKEEPING = {"metadata": {"team": "a"}, "store": False, "service_tier": "auto",
               "prompt_cache_key": "k-1", "prompt_cache_retention": "24h",
               "prompt_cache_options": {"ttl": "5m"}, "safety_identifier": "s-1",
               "user": "u-1", "session_id": "session-1", "return_token_offsets": True,
               "return_mm_kwargs": False, "routed_experts_prompt_start": 0,
               "length_penalty": 0.5}  # fmt: skip
NO_OPS = {"use_beam_search": False, "watermarking": None, "bad_words": [],
          "logprob_token_ids": None, "thinking_token_budget": -1, "repetition_detection": None,
          "vllm_xargs": {}, "kv_transfer_params": None, "ec_transfer_params": None}  # fmt: skip
CHAT_NO_OPS = {"include_reasoning": False, "prediction": {"type": "content", "content": "x"},
               "chat_template": None, "mm_processor_kwargs": {}, "media_io_kwargs": None,
               "modalities": ["text"]}  # fmt: skip


def test_bookkeeping_fields_are_accepted_and_change_nothing(client, served):
    """Through the openai client, as clients and gateways send them: the same greedy text."""
    kwargs = dict(model=MODEL_NAME, max_tokens=6, extra_body={"ignore_eos": True})
    plain = client.completions.create(prompt=PROMPT, **kwargs).choices[0].text
    chat_plain = client.chat.completions.create(messages=CHAT, **kwargs).choices[0].message
    extra = {"ignore_eos": True, **BOOKKEEPING, **NO_OPS}
    completion = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=6, extra_body={**extra, "prompt_embeds": None}
    )
    assert completion.choices[0].text == plain
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=6, metadata={"team": "a"}, store=False,
        service_tier="auto", prompt_cache_key="k-1", safety_identifier="s-1", user="u-1",
        stream_options=None, extra_body={**extra, **CHAT_NO_OPS},
    )  # fmt: skip
    assert chat.choices[0].message.content == chat_plain.content
    options = {"include_usage": True, "include_obfuscation": True}
    payloads = _streamed(served, "/v1/chat/completions",
                         {"messages": CHAT, "max_tokens": 6, "stream_options": options, **extra})  # fmt: skip
    text = "".join(c["delta"].get("content") or "" for p in payloads for c in p["choices"])
    assert text == chat_plain.content and payloads[-1]["usage"]["completion_tokens"] == 6


def test_skip_special_tokens_shows_them_whole_and_streamed(served, tokenizer):
    """A special token that is no EOS (<|im_start|>) pushed to the top, three times."""
    body = {"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True, "logit_bias": {"1": 100},
            "return_token_ids": True}  # fmt: skip
    shown = tokenizer.decode([1, 1, 1], skip_special_tokens=False)
    assert shown == "<|im_start|>" * 3
    for path, text_of in (
        ("/v1/completions", lambda choice: choice["text"]),
        ("/v1/chat/completions", lambda choice: choice["message"]["content"]),
    ):
        request = body if path == "/v1/completions" else {**body, "messages": CHAT}
        if "messages" in request:
            request = {k: v for k, v in request.items() if k != "prompt"}
        for fields, expected in (({}, ""), ({"skip_special_tokens": False}, shown),
                                 ({"skip_special_tokens": False,
                                   "spaces_between_special_tokens": False}, shown)):  # fmt: skip
            status, _, answer = post_json(served.base_url, path, {**request, **fields})
            assert status == 200, answer
            (choice,) = answer["choices"]
            assert choice["token_ids"] == [1, 1, 1] and text_of(choice) == expected, fields
            payloads = _streamed(served, path, {**request, **fields})
            deltas = [c.get("text", c.get("delta", {}).get("content")) or ""
                      for p in payloads for c in p["choices"]]  # fmt: skip
            assert "".join(deltas) == expected


def test_return_token_ids_are_the_prompts_and_the_outputs(served, tokenizer):
    """The prompt's ids are /tokenize's; the output's decode to the text, whole and streamed
    (streamed: the prompt's with a choice's first chunk, then each chunk's own)."""
    _, _, tokenized = post_json(served.base_url, "/tokenize", {"prompt": PROMPT})
    body = {"prompt": PROMPT, "max_tokens": 5, "ignore_eos": True, "return_token_ids": True}
    _, _, whole = post_json(served.base_url, "/v1/completions", body)
    (choice,) = whole["choices"]
    assert choice["prompt_token_ids"] == tokenized["tokens"]
    assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"] == 5
    assert tokenizer.decode(choice["token_ids"]) == choice["text"]
    streamed = [c for p in _streamed(served, "/v1/completions", body) for c in p["choices"]]
    assert streamed[0]["prompt_token_ids"] == tokenized["tokens"]
    assert all("prompt_token_ids" not in c for c in streamed[1:])
    assert [t for c in streamed for t in c["token_ids"]] == choice["token_ids"]
    _, _, chat_tokens = post_json(served.base_url, "/tokenize", {"messages": CHAT})
    chat = {"messages": CHAT, "max_tokens": 5, "ignore_eos": True, "return_token_ids": True}
    _, _, answer = post_json(served.base_url, "/v1/chat/completions", chat)
    assert answer["prompt_token_ids"] == chat_tokens["tokens"]
    assert len(answer["choices"][0]["token_ids"]) == 5
    payloads = _streamed(served, "/v1/chat/completions", chat)
    assert payloads[0]["prompt_token_ids"] == chat_tokens["tokens"]
    ids = [t for p in payloads for c in p["choices"] for t in c["token_ids"]]
    assert ids == answer["choices"][0]["token_ids"]
    # Without it, no such fields at all.
    _, _, bare = post_json(served.base_url, "/v1/completions", {**body, "return_token_ids": None})
    assert "token_ids" not in bare["choices"][0] and "prompt_token_ids" not in bare["choices"][0]


def test_request_id_is_the_responses_id(served):
    """vLLM's request_id names the response; two requests may share one (the engine's own ids
    stay unique)."""
    completion = {"prompt": PROMPT, "max_tokens": 2, "request_id": "trace-7"}
    chat = {"messages": CHAT, "max_tokens": 2, "request_id": "trace-7"}
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: post_json(served.base_url, "/v1/completions",
                                                    completion), range(2)))  # fmt: skip
    assert [a[2]["id"] for a in answers] == ["cmpl-trace-7"] * 2
    _, _, answer = post_json(served.base_url, "/v1/chat/completions", chat)
    assert answer["id"] == "chatcmpl-trace-7"
    assert {p["id"] for p in _streamed(served, "/v1/chat/completions", chat)} == {
        "chatcmpl-trace-7"
    }
    _refused(served, "/v1/completions", {**completion, "request_id": "x" * 257}, "request_id")


def test_continuous_usage_and_stream_interval_through_the_server(served):
    body = {"messages": CHAT, "max_tokens": 7, "ignore_eos": True, "stream_interval": 2,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    payloads = _streamed(served, "/v1/chat/completions", body)
    chunks, last = payloads[:-1], payloads[-1]
    assert [p["usage"]["completion_tokens"] for p in chunks] == [1, 3, 5, 7]
    prompt_tokens = last["usage"]["prompt_tokens"]
    assert all(p["usage"]["prompt_tokens"] == prompt_tokens for p in chunks)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 7
    refused = {**body, "stream": True, "stream_interval": 0}
    _refused(served, "/v1/chat/completions", refused, "stream_interval")


def test_chat_templating_fields_render_as_transformers_renders_them(client, served, tokenizer):
    said = [*CHAT, {"role": "assistant", "content": "Once upon"}]

    def rendered(messages: list[Any], **kwargs: Any) -> str:
        return tokenizer.apply_chat_template(
            messages, chat_template=TEMPLATE, tokenize=False, **kwargs
        )

    continued = rendered(said, continue_final_message=True)
    assert continued.endswith("Once upon")
    body = {"messages": said, "add_generation_prompt": False, "continue_final_message": True,
            "max_tokens": 3, "return_prompt_text": True, "echo": True, "return_token_ids": True}  # fmt: skip
    status, _, answer = post_json(served.base_url, "/v1/chat/completions", body)
    assert status == 200, answer
    assert answer["prompt_text"] == continued
    expected_ids = list(tokenizer(continued, add_special_tokens=False).input_ids)
    assert answer["prompt_token_ids"] == expected_ids
    message = answer["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"].startswith("Once upon")
    _, _, tokenized = post_json(served.base_url, "/tokenize", {k: body[k] for k in
                                ("messages", "add_generation_prompt", "continue_final_message")})  # fmt: skip
    assert tokenized["tokens"] == expected_ids
    assert "add_generation_prompt" in _refused(
        served, "/v1/chat/completions", {"messages": said, "continue_final_message": True},
        "continue_final_message",
    )  # fmt: skip
    # reasoning_effort "none" turns thinking off in the template, as enable_thinking: false does.
    _, _, off = post_json(served.base_url, "/tokenize",
                          {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    effort = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=1, reasoning_effort="none"
    )
    assert effort.usage.prompt_tokens == off["count"]
    _refused(served, "/v1/chat/completions", {"messages": CHAT, "reasoning_effort": "huge"},
             "reasoning_effort")  # fmt: skip
    # documents go to templates that use them (this one does not); add_special_tokens adds
    # what the tokenizer adds (the tiny one adds nothing).
    _, _, default = post_json(served.base_url, "/tokenize", {"messages": CHAT})
    for fields in ({"documents": [{"title": "t", "text": "x"}]}, {"add_special_tokens": True}):
        response = client.chat.completions.create(
            model=MODEL_NAME, messages=CHAT, max_tokens=1, extra_body=fields
        )
        assert response.usage.prompt_tokens == default["count"]


def test_completion_fields_response_format_truncation_side_and_token_id_names(served, tokenizer):
    schema = {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"],
              "additionalProperties": False}  # fmt: skip
    response_format = {"type": "json_schema", "json_schema": {"name": "k", "schema": schema}}
    body = {"prompt": PROMPT, "max_tokens": 32, "temperature": 1.0, "seed": 2, "n": 2,
            "response_format": response_format}  # fmt: skip
    status, _, answer = post_json(served.base_url, "/v1/completions", body)
    assert status == 200, answer
    assert all(json.loads(c["text"])["k"] in (1, 2) for c in answer["choices"])
    _, _, tokenized = post_json(served.base_url, "/tokenize", {"prompt": PROMPT})
    ids = tokenized["tokens"]
    cut = {"prompt": PROMPT, "max_tokens": 2, "return_token_ids": True, "truncate_prompt_tokens": 3}
    for side, kept in ((None, ids[-3:]), ("left", ids[-3:]), ("right", ids[:3])):
        _, _, answer = post_json(served.base_url, "/v1/completions",
                                 {**cut, "truncation_side": side})  # fmt: skip
        assert answer["choices"][0]["prompt_token_ids"] == kept, side
    _, _, whole = post_json(
        served.base_url, "/v1/completions", {**cut, "truncate_prompt_tokens": -1}
    )
    assert whole["choices"][0]["prompt_token_ids"] == ids
    _refused(served, "/v1/completions", {**cut, "truncation_side": "middle"}, "truncation_side")
    named = {"prompt": PROMPT, "max_tokens": 3, "logprobs": 1, "return_token_ids": True,
             "return_tokens_as_token_ids": True}  # fmt: skip
    _, _, answer = post_json(served.base_url, "/v1/completions", named)
    (choice,) = answer["choices"]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(k.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"] for k in top)
    chat = {"messages": CHAT, "max_tokens": 3, "logprobs": True, "top_logprobs": 1,
            "return_token_ids": True, "return_tokens_as_token_ids": True}  # fmt: skip
    _, _, answer = post_json(served.base_url, "/v1/chat/completions", chat)
    (choice,) = answer["choices"]
    entries = choice["logprobs"]["content"]
    assert [e["token"] for e in entries] == [f"token_id:{t}" for t in choice["token_ids"]]
