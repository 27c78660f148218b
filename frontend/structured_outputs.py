"""Structured outputs, frontend side: what a caller asks for -> one checked llguidance grammar.

Runs in the frontend process (``LLM`` and HTTP, through the ``InputProcessor``). The grammar
engine is llguidance: it needs no ahead-of-time compile (its Earley parser computes each
token mask on demand, tens of microseconds), so a new schema never holds up the engine's
steps, and its wheel has no dependencies. A request's ``StructuredOutputsParams`` (a JSON schema,
a regex, a choice, a Lark/GBNF grammar or "any JSON object") becomes an llguidance grammar here,
is checked against the model's tokenizer (an invalid schema or regex is a ``PromptError``
naming the problem, so an HTTP 400), and travels to the workers as ``SamplingParams.grammar``;
the workers hold one matcher per request (``worker/structured_output.py``).

JSON is generated compact (no free whitespace between tokens): a model may otherwise fill
``max_tokens`` with spaces, which is valid JSON nowhere.
"""

from __future__ import annotations

import functools
import json
import threading
from typing import Any

from conveyor.protocol import SamplingParams, StructuredOutputsParams

# llguidance's per-schema options: compact separators, no whitespace run the model could loop in.
JSON_OPTIONS = {"whitespace_flexible": False}


class StructuredOutputError(ValueError):
    """A constraint that cannot be used; the message says why."""


def grammar_of(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON text) for ``spec``, not yet checked."""
    from llguidance import LLMatcher, grammar_from

    kinds = spec.kinds()
    if len(kinds) != 1:
        raise StructuredOutputError(
            "give exactly one of json, regex, choice, grammar, json_object; got "
            + (", ".join(kinds) or "none")
        )
    if spec.json is not None:
        schema = spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise StructuredOutputError(f"the JSON schema is not JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise StructuredOutputError("a JSON schema must be an object")
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if spec.json_object:
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if spec.regex is not None:
        return grammar_from("regex", spec.regex)
    if spec.choice is not None:
        if not spec.choice or not all(isinstance(c, str) and c for c in spec.choice):
            raise StructuredOutputError("choice must be a list of non-empty strings")
        return grammar_from("choice", json.dumps(spec.choice))
    assert spec.grammar is not None
    return grammar_from("grammar", spec.grammar)


class GrammarChecker:
    """Checks grammars against one tokenizer; the llguidance tokenizer is built on first use."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._hf_tokenizer = tokenizer
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
        from llguidance import LLMatcher

        return LLMatcher.validate_grammar(grammar, self.ll_tokenizer()) or None

    def resolve(self, params: SamplingParams) -> SamplingParams:
        """``params`` with its ``structured_outputs`` turned into a checked ``grammar``."""
        spec = params.structured_outputs
        if spec is None:
            return params
        grammar = grammar_of(spec)
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
