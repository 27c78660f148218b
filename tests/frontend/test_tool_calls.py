"""Tool-call parsers on scripted outputs: whole, and streamed split at every point of the text.

Each case is a text a model of the family writes and the calls vLLM's parser of the same name
gives for it (names and arguments compared as JSON values: vLLM re-serializes the arguments of
a whole response, conveyor keeps the model's text so that a stream's fragments join to exactly
the whole response's arguments).
"""

from __future__ import annotations

import json

import pytest

from conveyor.frontend.parsers.tool_calls import TOOL_CALL_PARSERS, tool_call_parser
from conveyor.frontend.parsers.tool_calls.forced import (
    NamedCallParser,
    RequiredCallsParser,
    forced_schema,
)
from conveyor.frontend.parsers.tool_calls.stream import ToolCallStream

WEATHER = {"city": "Paris", "unit": "C"}
HERMES = (
    "Let me check.\n<tool_call>\n"
    + json.dumps({"name": "get_weather", "arguments": WEATHER})
    + "\n</tool_call>\n<tool_call>\n"
    + json.dumps({"name": "get_time", "arguments": {"zone": "CET"}})
    + "\n</tool_call>"
)
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}; ' + (
    '{"name": "get_time", "parameters": {"zone": "CET"}}'
)
TWO_CALLS = [("get_weather", WEATHER), ("get_time", {"zone": "CET"})]

# (parser, model output, content, [(name, arguments)]) as vLLM's parser reads them.
CASES = [
    ("hermes", HERMES, "Let me check.\n", TWO_CALLS),
    ("hermes", "No tools needed.", "No tools needed.", []),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', None, [("f", {})]),
    # The closing tag not yet written (EOS right after the JSON): still a call, as in vLLM.
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": [1, {"b": "}"}]}}', None,
     [("f", {"a": [1, {"b": "}"}]})]),
    ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("llama3_json", LLAMA, None, TWO_CALLS),
    ("llama3_json", '{"name": "f", "arguments": {"x": 1.5}}', None, [("f", {"x": 1.5})]),
    ("llama3_json", "The weather is fine.", "The weather is fine.", []),
    ("llama3_json", "{broken", "{broken", []),
    ("mistral", 'Sure.[TOOL_CALLS]add{"a": 3.5, "b": 4}[TOOL_CALLS]mul{"c": 2}', "Sure.",
     [("add", {"a": 3.5, "b": 4}), ("mul", {"c": 2})]),
    ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 1}', None, [("add", {"a": 1})]),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5, "b": 4}}]', None,
     [("add", {"a": 3.5, "b": 4})]),
    ("mistral", "No calls here.", "No calls here.", []),
    ("pythonic", "[get_weather(city='San Francisco', metric='celsius')]", None,
     [("get_weather", {"city": "San Francisco", "metric": "celsius"})]),
    ("pythonic", "[register_user(name='John Doe', age=37, address={'city': 'SF'}, role=None, "
     "passed_test=True, aliases=['John', 'Johnny']), get_weather()]", None,
     [("register_user", {"name": "John Doe", "age": 37, "address": {"city": "SF"}, "role": None,
                         "passed_test": True, "aliases": ["John", "Johnny"]}),
      ("get_weather", {})]),
    ("pythonic", r"[get_weather(city='Martha\'s Vineyard', metric='\"cool units\"')]", None,
     [("get_weather", {"city": "Martha's Vineyard", "metric": '"cool units"'})]),
    ("pythonic", "[bad(x=b'z'), calc(x=1e999), get_weather(city='SF')]", None,
     [("get_weather", {"city": "SF"})]),
    ("pythonic", "[f(a='x 'y' 'z), g(b='p 'q' 'r)]", "[f(a='x 'y' 'z), g(b='p 'q' 'r)]", []),
    ("pythonic", "<|python_start|>[get_weather(city='SF')]<|python_end|>", None,
     [("get_weather", {"city": "SF"})]),
    ("pythonic", "How can I help you today?", "How can I help you today?", []),
    ("qwen3_coder", "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
     "Paris\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
     "Let me check.\n", [("get_weather", {"city": "Paris", "days": 3})]),
    ("qwen3_coder", "<tool_call>\n<function=get_time>\n</function>\n</tool_call>", None,
     [("get_time", {})]),
    ("deepseek_v3", "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
     'get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     "Sure.", [("get_weather", {"city": "Paris"})]),
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
     '{"city": "Paris", "unit": "C"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time'
     '<｜tool▁sep｜>{"zone": "CET"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', None, TWO_CALLS),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
     '"C"}}, {"name": "get_time", "arguments": {"zone": "CET"}}]', None, TWO_CALLS),
    ("granite", "It is sunny.", "It is sunny.", []),
    ("kimi_k2", "Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
     '<|tool_call_argument_begin|>{"city": "Paris", "unit": "C"}<|tool_call_end|>'
     "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>"
     '{"zone": "CET"}<|tool_call_end|><|tool_calls_section_end|>', "Checking.", TWO_CALLS),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
     "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>", None,
     [("get_weather", {"city": "Paris", "days": 3})]),
    ("internlm", 'Sure.<|action_start|><|plugin|>\n{"name": "get_weather", "parameters": '
     '{"city": "Paris"}}<|action_end|>', "Sure.", [("get_weather", {"city": "Paris"})]),
    ("openai", "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
     "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
     '{"city": "Paris"}', None, [("get_weather", {"city": "Paris"})]),
    ("openai", "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
     "<|message|>It is 4.", "It is 4.", []),
]  # fmt: skip


def _values(calls) -> list[tuple[str, object]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


def stream(parser, text: str, cuts: list[int], max_calls: int | None = None):
    """The joined content and the calls (id, name, joined arguments) of ``text`` sent in pieces
    ending at ``cuts``; also every delta, to check none is empty."""
    calls_stream = ToolCallStream(parser, max_calls)
    content, calls, pieces = "", {}, []
    bounds = [c for c in cuts if 0 < c < len(text)] + [len(text)]
    for end in bounds:
        out, deltas = calls_stream.feed(text[:end], done=end == len(text))
        content += out
        pieces += deltas
        for delta in deltas:
            call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            if delta.name is not None:
                assert call["name"] is None and delta.id, "a call's header goes out once"
                call["id"], call["name"] = delta.id, delta.name
            else:
                assert call["name"] is not None, "arguments before the call's name"
                assert delta.arguments, "an empty arguments fragment"
                call["arguments"] += delta.arguments
    return content, [calls[i] for i in sorted(calls)], pieces


@pytest.mark.parametrize(("name", "text", "content", "expected"), CASES)
def test_each_format_reads_whole_and_streamed_at_every_split(name, text, content, expected):
    parser = tool_call_parser(name)
    got_content, calls = parser.parse(text)
    assert got_content == content
    assert _values(calls) == expected
    assert len({c.id for c in calls}) == len(calls)
    splits = [[i] for i in range(len(text))] + [list(range(len(text)))]
    for cuts in splits:
        streamed_content, streamed_calls, _ = stream(parser, text, cuts)
        assert streamed_content == (content or "")
        assert [c["name"] for c in streamed_calls] == [n for n, _ in expected], cuts
        # The fragments join to exactly the whole response's arguments.
        assert [c["arguments"] for c in streamed_calls] == [c.arguments for c in calls], cuts


def test_text_parameters_take_the_types_the_tools_declare():
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {
                    "properties": {
                        "zip": {"type": "string"},
                        "n": {"type": "integer"},
                        "tags": {"type": "array"},
                    }
                },
            },
        }
    ]
    coder = "<tool_call>\n<function=f>\n<parameter=zip>\n75001\n</parameter>\n<parameter=n>\n" + (
        '3\n</parameter>\n<parameter=tags>\n["a"]\n</parameter>\n</function>\n</tool_call>'
    )
    glm = "<tool_call>f\n<arg_key>zip</arg_key><arg_value>75001</arg_value>\n" + (
        "<arg_key>n</arg_key><arg_value>3</arg_value></tool_call>"
    )
    expected = {"zip": "75001", "n": 3, "tags": ["a"]}
    assert (
        json.loads(tool_call_parser("qwen3_coder", tools).parse(coder)[1][0].arguments) == expected
    )
    del expected["tags"]
    assert json.loads(tool_call_parser("glm45", tools).parse(glm)[1][0].arguments) == expected


def test_kimi_k2_ids_are_the_models_and_mistral_ids_its_format():
    text = next(c[1] for c in CASES if c[0] == "kimi_k2")
    calls = tool_call_parser("kimi_k2").parse(text)[1]
    assert [c.id for c in calls] == ["functions.get_weather:0", "functions.get_time:1"]
    _, streamed, _ = stream(tool_call_parser("kimi_k2"), text, list(range(len(text))))
    assert [c["id"] for c in streamed] == ["functions.get_weather:0", "functions.get_time:1"]
    text = next(c[1] for c in CASES if c[0] == "mistral")
    for call in tool_call_parser("mistral").parse(text)[1]:
        assert len(call.id) == 9 and call.id.isalnum()


def test_every_registered_name_makes_a_parser():
    for name in TOOL_CALL_PARSERS:
        assert tool_call_parser(name).scan("", done=True).content == ""


def test_a_call_streams_its_name_first_then_its_arguments_as_written():
    text = HERMES
    start = text.index("<tool_call>")
    _, calls, pieces = stream(tool_call_parser("hermes"), text, list(range(len(text))))
    headers = [p for p in pieces if p.name is not None]
    fragments = [p for p in pieces if p.arguments is not None]
    assert [h.name for h in headers] == ["get_weather", "get_time"]
    # Character by character, the arguments go out in many fragments, not one at the end.
    assert len([f for f in fragments if f.index == 0]) > 10
    assert calls[0]["arguments"] == json.dumps(WEATHER)
    assert start > 0


def test_parallel_calls_cut_by_max_tokens_keep_the_whole_ones():
    cut = HERMES[: HERMES.rindex('"zone"')]
    content, calls = tool_call_parser("hermes").parse(cut)
    assert content == "Let me check.\n" and _values(calls) == TWO_CALLS[:1]
    cut = LLAMA[: LLAMA.rindex('"zone"')]
    assert _values(tool_call_parser("llama3_json").parse(cut)[1]) == TWO_CALLS[:1]
    cut = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"y"'
    content, calls = RequiredCallsParser().parse(cut)
    assert content is None and _values(calls) == [("a", {"x": 1})]


def test_without_parallel_calls_the_first_call_is_kept():
    content, calls, _ = stream(tool_call_parser("hermes"), HERMES, [5, 40], max_calls=1)
    assert content == "Let me check.\n" and [c["name"] for c in calls] == ["get_weather"]


def test_forced_schemas_and_their_outputs():
    tools = [
        {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "b"}},
    ]
    one = forced_schema(tools, None, parallel=False)
    assert one["maxItems"] == 1 and one["minItems"] == 1
    assert "maxItems" not in forced_schema(tools, None, parallel=True)
    assert forced_schema(tools, "a", parallel=True) == {"type": "object"}
    with pytest.raises(ValueError, match="'c'"):
        forced_schema(tools, "c", parallel=True)
    required = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    assert _values(RequiredCallsParser().parse(required)[1]) == [("a", {"x": 1}), ("b", {})]
    assert _values(NamedCallParser("a").parse('{"x": 2}')[1]) == [("a", {"x": 2})]
    # Cut before any call is whole: the text is content.
    assert RequiredCallsParser().parse('[{"name": "a", "par') == ('[{"name": "a", "par', [])
    assert NamedCallParser("a").parse('{"x": ') == ('{"x": ', [])
    for parser, text in ((RequiredCallsParser(), required), (NamedCallParser("a"), '{"x": 2}')):
        whole = parser.parse(text)[1]
        for cut in range(len(text)):
            _, calls, _ = stream(parser, text, [cut])
            assert [c["arguments"] for c in calls] == [c.arguments for c in whole]


@pytest.mark.parametrize("depth", [100, 900, 990, 1100, 5000])
def test_arguments_nested_past_the_parsers_reach_are_content_never_an_error(depth):
    # A grammar may force a call this deep (tool_choice auto with a regex): json.loads gives up
    # with a RecursionError somewhere near 1,000 levels, which was a 500 and a stream's error
    # event. Shallow enough, it is a call; deeper, the text stays content.
    arguments = '{"a": ' + "[" * depth + "]" * depth + "}"
    hermes = f'<tool_call>{{"name": "f", "arguments": {arguments}}}</tool_call>'
    llama = f'{{"name": "f", "parameters": {arguments}}}'
    for name, text in (("hermes", hermes), ("llama3_json", llama)):
        parser = tool_call_parser(name)
        content, calls = parser.parse(text)
        assert (content, calls) == (text, []) or [c.name for c in calls] == ["f"]
        if depth >= 1100:
            assert (content, calls) == (text, [])
        streamed_content, streamed_calls, _ = stream(parser, text, list(range(0, len(text), 500)))
        assert streamed_content == text or [c["name"] for c in streamed_calls] == ["f"]
    if depth >= 1100:
        assert NamedCallParser("f").parse(arguments)[1] == []
        assert RequiredCallsParser().parse(f'[{{"name": "f", "parameters": {arguments}}}]')[1] == []
    if depth == 100:
        parsed = tool_call_parser("hermes").parse(hermes)[1][0].arguments
        assert json.loads(parsed) == json.loads(arguments)


# ---------------------------------------------------------------- through the chat handler


@pytest.fixture(scope="module")
def handler_state(tiny_model_dir):
    """A chat handler on a scripted engine that answers with ``SCRIPT[0]`` one token a step."""
    import msgspec

    from conveyor.frontend.server.serving import ServingState
    from conveyor.frontend.tokenizer import load_tokenizer
    from conveyor.protocol import (
        CacheConfig,
        EngineConfig,
        EngineCoreOutput,
        ModelConfig,
        SchedulerConfig,
    )
    from tests.frontend.test_http_serving import ScriptedEngineClient

    tokenizer = load_tokenizer(tiny_model_dir)
    script: list[str] = ["", "stop"]  # the text, and how it ends (stop: EOS; length: cut)

    def play(request):
        token_ids = tokenizer(script[0], add_special_tokens=False).input_ids
        outputs = [EngineCoreOutput(request.request_id, [t]) for t in token_ids]
        if script[1] == "length":
            outputs[-1].finish_reason = "length"
        else:
            outputs.append(EngineCoreOutput(request.request_id, [2], finish_reason="stop"))
        return outputs

    def state(parser: str) -> ServingState:
        model = ModelConfig(str(tiny_model_dir), "Qwen3ForCausalLM", 2048, 4096, (2, 0))
        model = msgspec.structs.replace(model, tool_call_parser=parser)
        config = EngineConfig(
            model, CacheConfig(block_size=16), SchedulerConfig(max_model_len=4096)
        )
        client = ScriptedEngineClient(config, play)
        return ServingState(client, tokenizer, "tiny", None, 1 << 20)  # type: ignore[arg-type]

    return state, script


def _chat(state, body):
    import asyncio

    from conveyor.frontend.server.chat import create_chat_completion
    from conveyor.frontend.server.request_models import ChatCompletionRequest, decode_body

    async def never_disconnects():
        await asyncio.Event().wait()

    async def run():
        request = decode_body(json.dumps(body).encode(), ChatCompletionRequest)
        response = await create_chat_completion(state, request, never_disconnects)
        if not body.get("stream"):
            return json.loads(response.body)
        return b"".join([chunk async for chunk in response.body_iterator])

    result = asyncio.run(run())
    if not body.get("stream"):
        return result
    events = result.decode().split("\n\n")
    return [json.loads(e.removeprefix("data: ")) for e in events if e and "[DONE]" not in e]


CALL_CASES = [case for case in CASES if case[3]]
HANDLER_TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
                 for name in ("get_weather", "get_time", "f", "add", "mul", "register_user",
                              "calc", "bad")]  # fmt: skip


@pytest.mark.parametrize(("name", "text", "content", "expected"), CALL_CASES)
def test_auto_calls_of_every_format_come_out_of_the_chat_handler(
    handler_state, name, text, content, expected
):
    make, script = handler_state
    script[:] = [text, "stop"]
    state = make(name)
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": HANDLER_TOOLS,
            "tool_choice": "auto", "max_tokens": 500}  # fmt: skip
    whole = _chat(state, body)["choices"][0]
    assert whole["finish_reason"] == "tool_calls"
    assert whole["message"]["content"] == content
    calls = whole["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == (
        expected
    )
    events = _chat(state, {**body, "stream": True})
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == (content or "")
    streamed: dict[int, list[str]] = {}
    for delta in deltas:
        for call in delta.get("tool_calls") or []:
            parts = streamed.setdefault(call["index"], ["", ""])
            parts[0] += call["function"].get("name") or ""
            parts[1] += call["function"].get("arguments") or ""
    assert [streamed[i] for i in sorted(streamed)] == [
        [c["function"]["name"], c["function"]["arguments"]] for c in calls
    ]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # none: no parsing, the text is content.
    none = _chat(state, {**body, "tool_choice": "none"})["choices"][0]["message"]
    assert none["content"] == text and "tool_calls" not in none


def test_parallel_calls_cut_by_max_tokens_report_the_whole_ones_through_the_handler(handler_state):
    make, script = handler_state
    script[:] = [HERMES[: HERMES.rindex('"zone"')], "length"]
    state = make("hermes")
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": HANDLER_TOOLS,
            "max_tokens": 500}  # fmt: skip
    whole = _chat(state, body)["choices"][0]
    calls = whole["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert whole["message"]["content"] == "Let me check.\n"
    events = _chat(state, {**body, "stream": True})
    deltas = [c["delta"] for e in events for c in e["choices"]]
    names = [c["function"]["name"] for d in deltas for c in d.get("tool_calls") or []
             if "name" in c["function"]]  # fmt: skip
    assert names == ["get_weather", "get_time"]  # the cut call's header went out as it came
    first = "".join(c["function"].get("arguments", "") for d in deltas
                    for c in d.get("tool_calls") or [] if c["index"] == 0)  # fmt: skip
    assert first == calls[0]["function"]["arguments"]
