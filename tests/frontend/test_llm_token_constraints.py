"""logit_bias, allowed_token_ids and min_tokens, end to end through ``LLM`` and the real sampler.

One in-process engine per module on the tiny Qwen3. Each test compares against the same prompt
without the field (greedy, so the difference is the field's doing alone), and checks the rule
on every token of the output, not on a sample of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from conveyor.frontend import LLM
from conveyor.protocol import SamplingParams

PROMPT = "def main():\n    "


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Iterator[LLM]:
    with LLM(str(tiny_model_dir), engine="inprocess", kv_cache_memory=16 << 20) as llm:
        yield llm


def _tokens(llm: LLM, **params: object) -> tuple[list[int], str | None]:
    (output,) = llm.generate([PROMPT], SamplingParams(**params), use_tqdm=False)[0].outputs
    return output.token_ids, output.finish_reason


def test_logit_bias_moves_the_greedy_choice_both_ways(llm):
    plain, _ = _tokens(llm, temperature=0, max_tokens=8, ignore_eos=True)
    favourite = 123
    assert favourite not in plain
    pushed, _ = _tokens(llm, temperature=0, max_tokens=8, ignore_eos=True,
                        logit_bias={favourite: 100.0})  # fmt: skip
    assert pushed == [favourite] * 8
    # Banning each token greedy took makes the next choice something else.
    banned, _ = _tokens(llm, temperature=0, max_tokens=8, ignore_eos=True,
                        logit_bias={t: -100.0 for t in set(plain)})  # fmt: skip
    assert not set(banned) & set(plain)


def test_allowed_token_ids_bound_every_sampled_token(llm):
    allowed = [40, 41, 42, 300]
    for seed in range(3):
        tokens, _ = _tokens(llm, temperature=1.0, seed=seed, max_tokens=24,
                            allowed_token_ids=allowed)  # fmt: skip
        assert len(tokens) == 24 and set(tokens) <= set(allowed), tokens
    greedy, _ = _tokens(llm, temperature=0, max_tokens=6, allowed_token_ids=[77])
    assert greedy == [77] * 6


def test_min_tokens_never_lets_eos_or_a_stop_token_out_early(llm, tiny_model_dir):
    eos = llm.config.model.eos_token_ids[0]
    # EOS pushed to the top: without min_tokens it is the first token and ends the output.
    first, reason = _tokens(llm, temperature=0, max_tokens=10, logit_bias={eos: 100.0})
    assert (first, reason) == ([eos], "stop")
    held, reason = _tokens(llm, temperature=0, max_tokens=10, min_tokens=4,
                           logit_bias={eos: 100.0})  # fmt: skip
    assert held[4:] == [eos] and eos not in held[:4] and reason == "stop", held
    # A stop token id the same way, sampled rather than greedy.
    stop = 99
    for seed in range(3):
        tokens, reason = _tokens(llm, temperature=1.0, seed=seed, max_tokens=12, min_tokens=5,
                                 stop_token_ids=[stop], logit_bias={stop: 100.0})  # fmt: skip
        assert tokens == [*tokens[:5], stop] and stop not in tokens[:5], tokens
        assert reason == "stop"
    # ignore_eos: EOS is not a stop token, so min_tokens leaves it alone.
    free, _ = _tokens(llm, temperature=0, max_tokens=3, min_tokens=3, ignore_eos=True,
                      logit_bias={eos: 100.0})  # fmt: skip
    assert free == [eos] * 3


def test_token_ids_outside_the_vocabulary_are_refused(llm):
    vocab_size = llm.config.model.vocab_size
    for params in (
        {"logit_bias": {vocab_size: 1.0}},
        {"allowed_token_ids": [vocab_size]},
    ):
        with pytest.raises(ValueError, match=str(vocab_size)):
            llm.generate([PROMPT], SamplingParams(**params), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias values"):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(ValueError, match="allowed_token_ids must not be empty"):
        SamplingParams(allowed_token_ids=[])
