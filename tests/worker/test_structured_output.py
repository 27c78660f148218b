"""The workers' grammar matchers: built off the step, once per grammar, and a matcher in error
reported as a failure (never a silent EOS)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conveyor.worker.structured_output import GrammarRuntime


@pytest.fixture(scope="module")
def grammars(tiny_model_dir: Path) -> GrammarRuntime:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    return GrammarRuntime(str(tiny_model_dir), config["vocab_size"], [config["eos_token_id"]])


def _regex(pattern: str) -> str:
    from llguidance import grammar_from

    return grammar_from("regex", pattern)


def test_a_grammar_is_built_once_on_its_thread_and_copied_for_each_request(grammars):
    grammar = _regex("(yes|no|maybe)")
    future = grammars.prepare(grammar)
    assert grammars.prepare(grammar) is future, "the same grammar is built once"
    template = future.result(timeout=30)
    first, second = grammars.new_matcher(grammar), grammars.new_matcher(grammar)
    assert first is not second and template not in (first, second)
    # Each copy advances on its own: one request's tokens never move another's matcher.
    GrammarRuntime.accept(first, _first_allowed(grammars, first))
    masks, failed = grammars.bitmask([(0, first), (1, second), (2, template)])
    assert failed == {}
    assert torch.equal(masks[1], masks[2]) and not torch.equal(masks[0], masks[1])


def test_a_matcher_that_fails_at_a_later_token_is_reported_with_its_reason(grammars):
    # No finite string: llguidance gives up at the second mask (its per-step item limit).
    matcher = grammars.new_matcher(_regex("a{1000000}"))
    masks, failed = grammars.bitmask([(0, matcher)])
    assert failed == {}
    GrammarRuntime.accept(matcher, _first_allowed(grammars, matcher))
    masks, failed = grammars.bitmask([(0, matcher)])
    assert list(failed) == [0] and "\n" not in failed[0] and len(failed[0]) <= 500, failed
    # Its row may still sample (EOS only): the request fails, the batch goes on.
    assert _allowed(masks[0], grammars.vocab_size) == grammars._eos_token_ids


def _allowed(mask: torch.Tensor, vocab_size: int) -> list[int]:
    words = mask.tolist()
    return [t for t in range(vocab_size) if (words[t // 32] >> (t % 32)) & 1]


def _first_allowed(grammars: GrammarRuntime, matcher) -> int:
    """The first token the matcher allows now, EOS aside."""
    masks, _ = grammars.bitmask([(0, matcher)])
    return next(
        t for t in _allowed(masks[0], grammars.vocab_size) if t not in grammars._eos_token_ids
    )
