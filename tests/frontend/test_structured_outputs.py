"""Structured outputs end to end through ``LLM``: a random-weight model under a grammar must
produce valid output every time, greedy and sampled, with n > 1, async scheduling, preemption
and tensor parallelism.

Schemas bound every string, array and number, so every output can finish within ``max_tokens``
(a grammar decides what may come, not when the model stops; an unbounded string could run to
the cap): the outputs are then checked with ``jsonschema`` (or ``re.fullmatch``), every one.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from llguidance import LLMatcher

from conveyor.frontend import LLM
from conveyor.protocol import SamplingParams, StructuredOutputsParams

PROMPTS = ["Hello", "def f(x):", "{"]
MAX_TOKENS = 256
NAME = {"type": "string", "maxLength": 10}
SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested_arrays_enums": {
        "type": "object",
        "properties": {
            "owner": {
                "type": "object",
                "properties": {"name": NAME, "admin": {"type": "boolean"}},
                "required": ["name", "admin"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
            "scores": {
                "type": "array",
                "items": {"type": "number", "minimum": 0, "maximum": 1},
                "maxItems": 2,
            },
        },
        "required": ["owner", "tags"],
        "additionalProperties": False,
    },
    "any_of_optional_pattern": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[a-z]{2}-[0-9]{3}$"},
            "when": {"type": "string", "format": "date"},
            "value": {
                "anyOf": [
                    {"type": "integer", "maximum": 999, "minimum": -999},
                    {"type": "null"},
                    {"enum": ["none", "all"]},
                ]
            },  # fmt: skip
            "note": NAME,
        },
        "required": ["id", "value"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Iterator[LLM]:
    with LLM(str(tiny_model_dir), engine="inprocess", kv_cache_memory=16 << 20) as llm:
        yield llm


def _texts(llm: LLM, spec: StructuredOutputsParams, **params: Any) -> list[str]:
    params = {"max_tokens": MAX_TOKENS, **params}
    sampling = SamplingParams(structured_outputs=spec, **params)
    outputs = llm.generate(PROMPTS, sampling, use_tqdm=False)
    choices = [c for out in outputs for c in out.outputs]
    assert all(c.finish_reason == "stop" for c in choices), [c.finish_reason for c in choices]
    return [c.text for c in choices]


def _check_json(texts: list[str], schema: dict[str, Any]) -> None:
    for text in texts:
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


@pytest.mark.parametrize("name", SCHEMAS)
def test_every_output_follows_its_schema_greedy_and_sampled_with_n(llm, name):
    schema = SCHEMAS[name]
    spec = StructuredOutputsParams(json=schema)
    greedy = _texts(llm, spec, temperature=0)
    _check_json(greedy, schema)
    for seed in range(3):
        sampled = _texts(llm, spec, n=3, temperature=1.0, seed=seed)
        assert len(sampled) == 3 * len(PROMPTS)
        _check_json(sampled, schema)
    # The JSON text of the schema works as the schema.
    assert _texts(llm, StructuredOutputsParams(json=json.dumps(schema)), temperature=0) == greedy


def test_regex_choice_grammar_and_json_object(llm):
    for text in _texts(llm, StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"), n=2,
                       temperature=1.0, seed=3):  # fmt: skip
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text), text
    choices = ["yes", "no", 'it "depends"']
    picked = _texts(llm, StructuredOutputsParams(choice=choices), n=3, temperature=1.0, seed=1)
    assert set(picked) <= set(choices)
    lark = 'start: "SELECT " column " FROM t"\ncolumn: "a" | "b" | "c"'
    for text in _texts(llm, StructuredOutputsParams(grammar=lark), n=2, temperature=1.0, seed=2):
        assert re.fullmatch(r"SELECT [abc] FROM t", text), text
    gbnf = 'root ::= "x" [0-9] [0-9]'
    for text in _texts(llm, StructuredOutputsParams(grammar=gbnf), n=2, temperature=1.0, seed=2):
        assert re.fullmatch(r"x[0-9][0-9]", text), text
    # Any JSON object: nothing bounds its strings, so a random model writes one key until
    # max_tokens. Every token it wrote must still follow the grammar, checked by a fresh matcher.
    spec = StructuredOutputsParams(json_object=True)
    sampling = SamplingParams(structured_outputs=spec, max_tokens=64, temperature=1.0, seed=5)
    (output,) = llm.generate(PROMPTS[:1], sampling, use_tqdm=False)[0].outputs
    checker = llm.input_processor.grammars
    grammar = llm.input_processor.resolve_structured_outputs(sampling).grammar
    matcher = LLMatcher(checker.ll_tokenizer(), grammar)
    assert output.text.startswith("{") and len(output.token_ids) == 64
    assert matcher.try_consume_tokens(output.token_ids) == 64 and not matcher.is_error()


def test_unconstrained_requests_in_the_same_batch_are_untouched(llm):
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPTS, plain, use_tqdm=False)
    spec = StructuredOutputsParams(json=SCHEMAS["flat"])
    constrained = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=spec)
    mixed = llm.generate([*PROMPTS, *PROMPTS], [plain] * 3 + [constrained] * 3, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == [o.outputs[0].token_ids for o in alone]
    _check_json([o.outputs[0].text for o in mixed[3:]], SCHEMAS["flat"])


def test_invalid_constraints_are_refused_with_the_problem(llm):
    for spec, message in (
        (StructuredOutputsParams(json={"type": "frobnicate"}), "frobnicate"),
        (StructuredOutputsParams(json="{not json"), "not JSON"),
        (StructuredOutputsParams(regex="a(b"), "unclosed group"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "undefined_rule"),
        (StructuredOutputsParams(choice=[]), "choice"),
    ):
        with pytest.raises(ValueError, match=message):
            llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=spec), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a", choice=["a"]))


# Constraints llguidance finds unusable only past the first token (a grammar with no finite
# string, a lexer or parser limit reached at the second mask): each must end its request with an
# error naming the constraint (or be refused at once), never with EOS read as a finished answer.
LOOP = {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"]}
LATE_FAILURES = {
    "lark without a finite string": StructuredOutputsParams(grammar='start: "a" start'),
    "gbnf without a finite string": StructuredOutputsParams(grammar='root ::= "a" root'),
    "regex a{1000000}": StructuredOutputsParams(regex="a{1000000}"),
    "a $ref loop no value satisfies": StructuredOutputsParams(
        json={"$defs": {"A": LOOP}, "$ref": "#/$defs/A"}
    ),
}


@pytest.mark.parametrize("name", LATE_FAILURES)
def test_a_constraint_that_fails_at_a_later_token_is_an_error_never_a_stop(llm, name):
    spec = LATE_FAILURES[name]
    for params in ({"temperature": 0}, {"temperature": 1.0, "seed": 3, "n": 4}):
        sampling = SamplingParams(structured_outputs=spec, max_tokens=32, **params)
        try:
            outputs = llm.generate(PROMPTS[:1], sampling, use_tqdm=False)
        except ValueError as exc:  # refused at the door: as good
            assert "invalid" in str(exc), exc
            continue
        for choice in outputs[0].outputs:
            assert choice.finish_reason == "error", (choice.finish_reason, choice.text)
            assert str(choice.stop_reason).startswith("structured output: "), choice.stop_reason
    llm.check_all_free()


def test_a_choice_among_thousands_is_one_of_them(llm):
    """A choice list is a regex alternation: 3,000 strings sharing a prefix (a grammar row of
    3,001 items, over llguidance's 2,000) still give one of them, greedy and sampled."""
    choices = [f"item {i} of the list" for i in range(3000)]
    spec = StructuredOutputsParams(choice=choices)
    texts = _texts(llm, spec, temperature=0) + _texts(llm, spec, temperature=1.0, seed=1, n=3)
    assert texts and all(text in choices for text in texts), texts


def test_constraints_over_the_size_caps_are_refused_at_once(llm):
    from conveyor.frontend import structured_outputs as caps

    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1)}}
    too_big_schema = json.dumps({**schema, "description": "x" * caps.MAX_JSON_SCHEMA_CHARS})
    for spec, message in (
        (StructuredOutputsParams(choice=[f"c{i}" for i in range(40_000)]), "at most 16384"),
        (StructuredOutputsParams(regex="(" + "|".join(f"w{i}" for i in range(150_000)) + ")"),
         "regex may hold at most"),
        (StructuredOutputsParams(json=too_big_schema), "json may hold at most"),
        (StructuredOutputsParams(grammar="start: " + '"a" | ' * 60_000 + '"b"'),
         "grammar may hold at most"),
    ):  # fmt: skip
        start = time.perf_counter()
        with pytest.raises(ValueError, match=message):
            llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=spec), use_tqdm=False)
        assert time.perf_counter() - start < 1.0, message


@pytest.mark.slow
def test_async_scheduling_preemption_and_tensor_parallel_give_the_same_valid_outputs(
    tiny_model_dir, llm
):
    """The worker keeps each request's matcher: with async scheduling (a token in flight), a
    KV cache so small that requests are preempted and recomputed, and two TP ranks, greedy
    structured outputs equal the plain engine's, token for token."""
    schema = SCHEMAS["nested_arrays_enums"]
    spec = StructuredOutputsParams(json=schema)
    prompts = [f"{p} {i}" for i in range(4) for p in PROMPTS]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=spec)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    setups: list[dict[str, Any]] = [
        {"engine": "inprocess", "async_scheduling": True, "kv_cache_memory": 16 << 20},
        # 16 blocks of 16 tokens for 12 requests of 3 blocks or so each: preemptions.
        {"engine": "inprocess", "kv_cache_memory": 16 * 16 * 512, "max_model_len": 200},
        {"tensor_parallel_size": 2, "kv_cache_memory": 16 << 20},
    ]
    for setup in setups:
        with LLM(str(tiny_model_dir), **setup) as other:
            outputs = other.generate(prompts, greedy, use_tqdm=False)
            stats = other.stats
        assert [o.outputs[0].token_ids for o in outputs] == expected, setup
        _check_json([o.outputs[0].text for o in outputs], schema)
        if setup.get("max_model_len"):
            assert stats is not None and stats.num_preemptions > 0, "no preemption happened"
