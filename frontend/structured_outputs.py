"""Structured outputs, frontend side: what a caller asks for -> one checked llguidance grammar.

Runs in the frontend process (``LLM`` and HTTP, through the ``InputProcessor``). The grammar
engine is llguidance: its Earley parser computes each token mask on demand (tens of
microseconds), and its wheel has no dependencies. The workers build each grammar's matcher on a
thread of their own while the engine holds the request back, so a new schema never holds up
the engine's steps. A request's ``StructuredOutputsParams`` (a JSON schema,
a regex, a choice, a Lark/GBNF grammar or "any JSON object") becomes an llguidance grammar here,
is checked against the model's tokenizer (an invalid schema or regex is a ``PromptError``
naming the problem, so an HTTP 400), and travels to the workers as ``SamplingParams.grammar``;
the workers hold one matcher per request (``worker/structured_output.py``).

JSON is generated compact (no free whitespace between tokens): a model may otherwise fill
``max_tokens`` with spaces, which is valid JSON nowhere. Object schemas are strict by default
(``close_objects``): an object admits no keys beyond its ``properties`` unless
``additionalProperties`` or ``patternProperties`` says so, as xgrammar's strict mode (vLLM's
default backend) and OpenAI's structured outputs have it; JSON Schema's own default (any key)
would let a model open a key of its own and write it until max_tokens. A server started with
``--default-additional-properties true`` keeps JSON Schema's default.

With a reasoning parser, a constraint applies to the answer after the reasoning
(``after_reasoning``): the grammar admits the reasoning parser's free text up to its end marker,
then the constraint, as vLLM starts its grammar after the end of the reasoning.

What a constraint may cost is bounded at the door (``MAX_*`` below, then llguidance's own limits,
``GRAMMAR_LIMITS``, set the same in the frontend and the workers): the check builds a matcher and
its first mask under them, so what fails early is a 400 in milliseconds, not a request that
stalls the engine or ends quietly with text that breaks its constraint. A ``choice`` list is a
regex alternation, not a grammar rule of N alternatives: the lexer takes tens of thousands of
strings in a fraction of a second, where a grammar row is capped at 2,000 items.
"""

from __future__ import annotations

import functools
import json
import threading
from typing import Any

from conveyor.protocol import SamplingParams, StructuredOutputsParams
from conveyor.protocol.sampling_params import GRAMMAR_LIMITS

# llguidance's per-schema options: compact separators, no whitespace run the model could loop in.
JSON_OPTIONS = {"whitespace_flexible": False}
# Caps checked before any grammar is built (each refusal names its field): sizes a real schema,
# pattern or choice list stays far below, and that keep the check and a worker's build of one
# grammar to a fraction of a second.
MAX_CHOICES = 16_384
MAX_CHOICE_CHARS = 1 << 20  # all the strings together
MAX_JSON_SCHEMA_CHARS = 256 << 10
MAX_REGEX_CHARS = 64 << 10
MAX_GRAMMAR_TEXT_CHARS = 256 << 10


class StructuredOutputError(ValueError):
    """A constraint that cannot be used; the message says why."""


def grammar_of(spec: StructuredOutputsParams, strict_objects: bool = True) -> str:
    """The llguidance grammar (its JSON text) for ``spec``, not yet checked."""
    from llguidance import LLMatcher, grammar_from

    kinds = spec.kinds()
    if len(kinds) != 1:
        raise StructuredOutputError(
            "give exactly one of json, regex, choice, grammar, json_object; got "
            + (", ".join(kinds) or "none")
        )
    check_sizes(spec)
    if spec.json is not None:
        schema = spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise StructuredOutputError(f"the JSON schema is not JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise StructuredOutputError("a JSON schema must be an object")
        if strict_objects:
            schema = close_objects(schema)
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if spec.json_object:
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if spec.regex is not None:
        return grammar_from("regex", spec.regex)
    if spec.choice is not None:
        if not spec.choice or not all(isinstance(c, str) and c for c in spec.choice):
            raise StructuredOutputError("choice must be a list of non-empty strings")
        return grammar_from("regex", "(" + "|".join(map(_regex_literal, spec.choice)) + ")")
    assert spec.grammar is not None
    return grammar_from("grammar", spec.grammar)


# Where a schema holds schemas: maps of them, lists of them, and single ones.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = (
    "items", "additionalProperties", "additionalItems", "unevaluatedProperties",
    "propertyNames", "contains", "not", "if", "then", "else",
)  # fmt: skip
_OPEN_OBJECT_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def close_objects(schema: Any, closable: bool = True) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that says nothing
    of keys beyond its properties. The parts of an ``allOf`` are not closed one by one (each
    would forbid the others' keys), nor is an object that has one; their nested schemas are."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(value) for name, value in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(value) for value in out[key]]
    for key in _SCHEMA_ONE:
        if key in out:
            out[key] = close_objects(out[key])
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [close_objects(value, closable=False) for value in out["allOf"]]
        closable = False
    types = out.get("type")
    is_object = types == "object" or (isinstance(types, list) and "object" in types)
    if closable and is_object and not any(key in out for key in _OPEN_OBJECT_KEYS):
        out["additionalProperties"] = False
    return out


_ANSWER = "answer"


def after_reasoning(grammar: str, prefix: str) -> str:
    """``grammar`` applied after the Lark rule ``reasoning`` that ``prefix`` defines (a
    reasoning parser's free text and end marker), with whitespace allowed between them."""
    if grammar.lstrip().startswith("{"):
        parts = json.loads(grammar)["grammars"]
        parts[0] = {**parts[0], "name": _ANSWER}
    else:
        parts = [{"name": _ANSWER, "lark_grammar": grammar}]
    lark = f"start: reasoning ANSWER_SPACE? @{_ANSWER}\nANSWER_SPACE: /[ \\t\\r\\n]+/\n{prefix}"
    return json.dumps({"grammars": [{"name": "after_reasoning", "lark_grammar": lark}, *parts]})


def check_sizes(spec: StructuredOutputsParams) -> None:
    """Refuse a constraint over the size caps before any work is spent on it."""
    if spec.choice is not None:
        if len(spec.choice) > MAX_CHOICES:
            raise StructuredOutputError(
                f"choice may list at most {MAX_CHOICES} strings, got {len(spec.choice)}"
            )
        total = sum(len(c) for c in spec.choice if isinstance(c, str))
        if total > MAX_CHOICE_CHARS:
            raise StructuredOutputError(
                f"choice's strings may hold at most {MAX_CHOICE_CHARS} characters together"
            )
    texts = (
        ("regex", spec.regex, MAX_REGEX_CHARS),
        ("grammar", spec.grammar, MAX_GRAMMAR_TEXT_CHARS),
        ("json", spec.json if isinstance(spec.json, str) else None, MAX_JSON_SCHEMA_CHARS),
    )
    for name, text, cap in texts:
        if text is not None and len(text) > cap:
            raise StructuredOutputError(f"{name} may hold at most {cap} characters")


def _regex_literal(text: str) -> str:
    """``text`` as a regex that matches it alone: every ASCII character but letters, digits and
    the space escaped (llguidance's regex syntax accepts an escape before any of them)."""
    return "".join(c if c.isalnum() or c == " " or not c.isascii() else "\\" + c for c in text)


class GrammarChecker:
    """Checks grammars against one tokenizer; the llguidance tokenizer is built on first use."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: list[int],
        strict_objects: bool = True,
    ) -> None:
        self._hf_tokenizer = tokenizer
        self._strict_objects = strict_objects
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        # The same schema sent again is checked once.
        self.check = functools.lru_cache(maxsize=512)(self._check)

    def ll_tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = make_ll_tokenizer(
                    self._hf_tokenizer, self._vocab_size, self._eos_token_ids
                )
            return self._ll_tokenizer

    def _check(self, grammar: str) -> str | None:
        """What is wrong with ``grammar`` (None: nothing found): a matcher built under the
        workers' limits (its errors are llguidance's validation's) and its first mask, where the
        lexer's and the parser's start show their limits."""
        from llguidance import LLMatcher, LLParserLimits

        limits = LLParserLimits(**GRAMMAR_LIMITS)
        matcher = LLMatcher(self.ll_tokenizer(), grammar, log_level=1, limits=limits)
        if not matcher.is_error():
            matcher.compute_bitmask()
        if not matcher.is_error():
            return None
        return matcher.get_error().replace("<non-verbose/>", "").strip() or "failed"

    def resolve(self, params: SamplingParams, after: str | None = None) -> SamplingParams:
        """``params`` with its ``structured_outputs`` turned into a checked ``grammar``;
        ``after``: the Lark rule ``reasoning`` it applies after (``after_reasoning``)."""
        spec = params.structured_outputs
        if spec is None:
            return params
        grammar = grammar_of(spec, self._strict_objects)
        if after is not None:
            grammar = after_reasoning(grammar, after)
        problem = self.check(grammar)
        if problem is not None:
            raise StructuredOutputError(f"invalid {spec.kinds()[0]}: {problem.strip()}")
        return _replace(params, structured_outputs=None, grammar=grammar)


def make_ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> Any:
    """llguidance's view of a Hugging Face tokenizer, as wide as the model's logits."""
    from llguidance.hf import from_tokenizer

    eos: int | list[int] | None = list(eos_token_ids) or None
    return from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)


def _replace(params: SamplingParams, **changes: Any) -> SamplingParams:
    import msgspec

    return msgspec.structs.replace(params, **changes)
