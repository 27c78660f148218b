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
