"""Tool-call parsers on scripted outputs: whole, and streamed in every split of the text."""

from __future__ import annotations

import json

import pytest

from conveyor.frontend.tool_calls import (
    HermesParser,
    Llama3JsonParser,
    ToolCallStream,
    forced_calls,
    forced_schema,
)

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


def _names_and_arguments(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


EXPECTED = [("get_weather", WEATHER), ("get_time", {"zone": "CET"})]


@pytest.mark.parametrize(
    ("parser", "text", "content"),
    [(HermesParser(), HERMES, "Let me check.\n"), (Llama3JsonParser(), LLAMA, None)],
)
def test_calls_are_read_whole_and_streamed_in_any_split(parser, text, content):
    got_content, calls = parser.parse(text)
    assert got_content == content and _names_and_arguments(calls) == EXPECTED
    assert len({c.id for c in calls}) == 2
    for size in (1, 3, 7, 50):
        stream = ToolCallStream(parser, False)
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        streamed_content, streamed_calls = "", []
        for i, piece in enumerate(pieces):
            out, new_calls = stream.feed(piece, done=i == len(pieces) - 1)
            streamed_content += out
            streamed_calls += new_calls
        assert streamed_content == (content or "")
        assert "<tool" not in streamed_content and "{" not in streamed_content
        assert _names_and_arguments(streamed_calls) == EXPECTED


@pytest.mark.parametrize("parser", [HermesParser(), Llama3JsonParser()])
def test_text_that_is_no_call_stays_content(parser):
    for text in ("Just words, no calls.", "<tool_call>{not json}</tool_call>", "{broken"):
        content, calls = parser.parse(text)
        assert (content, calls) == (text, [])
        stream = ToolCallStream(parser, False)
        assert stream.feed(text, done=True) == (text, [])
    # A growing text that only might start a call is held back, then released.
    stream = ToolCallStream(HermesParser(), False)
    assert stream.feed("a <tool", done=False) == ("a ", [])
    assert stream.feed("box", done=True) == ("<toolbox", [])


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
    calls = forced_calls(
        '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]', None
    )
    assert _names_and_arguments(calls) == [("a", {"x": 1}), ("b", {})]
    assert _names_and_arguments(forced_calls('{"x": 2}', "a")) == [("a", {"x": 2})]
    assert forced_calls('[{"name": "a", "par', None) == []  # cut at max_tokens
    # Without parallel calls, the first the model writes is the one kept.
    single = ToolCallStream(HermesParser(), False, max_calls=1)
    content, calls = single.feed(HERMES, done=True)
    assert content == "Let me check.\n" and _names_and_arguments(calls) == EXPECTED[:1]
    # Streamed: a forced output is held until it ends; cut, it goes out as content.
    stream = ToolCallStream(None, None)
    assert stream.feed('[{"name": "a", ', done=False) == ("", [])
    assert stream.feed('"par', done=True) == ('[{"name": "a", "par', [])
    named = ToolCallStream(None, "a")
    content, calls = named.feed('{"x": 3}', done=True)
    assert content == "" and _names_and_arguments(calls) == [("a", {"x": 3})]


@pytest.mark.parametrize("depth", [100, 900, 990, 1100, 5000])
def test_arguments_nested_past_the_parsers_reach_are_content_never_an_error(depth):
    # A grammar may force a call this deep (tool_choice auto with a regex): json.loads gives up
    # with a RecursionError somewhere near 1,000 levels, which was a 500 and a stream's error
    # event. Shallow enough, it is a call; deeper, the text stays content.
    arguments = '{"a": ' + "[" * depth + "]" * depth + "}"
    hermes = f'<tool_call>{{"name": "f", "arguments": {arguments}}}</tool_call>'
    llama = f'{{"name": "f", "parameters": {arguments}}}'
    for parser, text in ((HermesParser(), hermes), (Llama3JsonParser(), llama)):
        content, calls = parser.parse(text)
        assert (content, calls) == (text, []) or [c.name for c in calls] == ["f"]
        if depth >= 1100:
            assert (content, calls) == (text, [])
        stream = ToolCallStream(parser, False)
        streamed = [stream.feed(text[i : i + 500], done=i + 500 >= len(text))
                    for i in range(0, len(text), 500)]  # fmt: skip
        streamed_content = "".join(out for out, _ in streamed)
        streamed_calls = [call for _, new in streamed for call in new]
        assert streamed_content == text or [c.name for c in streamed_calls] == ["f"]
    if depth >= 1100:
        assert forced_calls(arguments, "f") == []
        assert forced_calls(f'[{{"name": "f", "parameters": {arguments}}}]', None) == []
    if depth == 100:
        assert json.loads(HermesParser().parse(hermes)[1][0].arguments) == json.loads(arguments)
