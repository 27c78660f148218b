"""Strict object schemas: an object admits no keys beyond its properties unless the schema says
so, as xgrammar's strict mode (vLLM's default backend) has it, and a server can switch back to
JSON Schema's default (``--default-additional-properties true``).

Runs in the test process, in milliseconds: schemas rewritten, and llguidance matchers on the
tiny model's tokenizer.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from llguidance import LLMatcher

from conveyor.frontend.engine_args import EngineArgs, add_engine_args
from conveyor.frontend.structured_outputs import GrammarChecker, close_objects, grammar_of
from conveyor.frontend.tokenizer import load_tokenizer
from conveyor.protocol import SamplingParams, StructuredOutputsParams

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_every_object_that_says_nothing_of_other_keys_is_closed():
    schema = {
        "type": "object",
        "properties": {
            "place": CITY,
            "tags": {"type": "array", "items": {"type": "object", "properties": {}}},
            "extra": {"type": "object", "additionalProperties": {"type": "integer"}},
            "named": {"type": "object", "patternProperties": {"^x": {}}},
            "either": {"anyOf": [CITY, {"type": "null"}]},
            "ref": {"$ref": "#/$defs/Zip"},
        },
        "$defs": {"Zip": {"type": "object", "properties": {"zip": {"type": "string"}}}},
    }
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    properties = closed["properties"]
    assert properties["place"]["additionalProperties"] is False
    assert properties["tags"]["items"]["additionalProperties"] is False
    assert properties["extra"]["additionalProperties"] == {"type": "integer"}  # said so
    assert "additionalProperties" not in properties["named"]  # its patterns admit keys
    assert properties["either"]["anyOf"][0]["additionalProperties"] is False
    assert closed["$defs"]["Zip"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the request's own schema is left as it was
    # The parts of an allOf would forbid each other's keys: left open, as is their object.
    combined = close_objects({"type": "object", "allOf": [CITY, {"properties": {"n": {}}}]})
    assert "additionalProperties" not in combined
    assert "additionalProperties" not in combined["allOf"][0]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


def _accepts(tokenizer: Any, checker: GrammarChecker, grammar: str, text: str) -> bool:
    matcher = LLMatcher(checker.ll_tokenizer(), grammar)
    return all(
        matcher.consume_token(t) for t in tokenizer(text, add_special_tokens=False).input_ids
    )


@pytest.mark.parametrize("strict", [True, False])
def test_a_key_of_the_models_own_is_refused_unless_the_server_is_permissive(tokenizer, strict):
    checker = GrammarChecker(tokenizer, 2048, [2], strict_objects=strict)
    params = checker.resolve(SamplingParams(structured_outputs=StructuredOutputsParams(json=CITY)))
    assert _accepts(tokenizer, checker, params.grammar, '{"city":"Paris"}')
    assert _accepts(tokenizer, checker, params.grammar, '{"city":"Paris","x":1') is not strict
    # "any JSON object" stays any object.
    anything = grammar_of(StructuredOutputsParams(json_object=True), strict_objects=strict)
    assert _accepts(tokenizer, checker, anything, '{"x":1,"y":[2]}')


def test_the_server_flag_reaches_the_model_config(tiny_model_dir):
    config = EngineArgs(str(tiny_model_dir), default_additional_properties=True)
    assert config.create_engine_config().model.strict_object_schemas is False
    assert EngineArgs(str(tiny_model_dir)).create_engine_config().model.strict_object_schemas
    parser = add_engine_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli(parser.parse_args([])).default_additional_properties is False
    args = parser.parse_args(["--default-additional-properties", "true"])
    assert EngineArgs.from_cli(args).default_additional_properties is True
    with pytest.raises(SystemExit):
        parser.parse_args(["--default-additional-properties", "yes"])
