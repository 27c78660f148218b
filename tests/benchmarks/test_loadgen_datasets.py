"""bench/loadgen/datasets.py: seeded, length-exact with a tokenizer, prefix groups that share."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conveyor.bench.loadgen.datasets import (
    WORDS,
    DatasetSpec,
    PromptMaker,
    load_tokenizer,
    make_dataset,
)

WORD_MAKER = PromptMaker(None, endpoint_takes_ids=True)


def test_random_is_seeded_and_lengths_follow_the_range_ratio():
    spec = DatasetSpec(random_input_len=40, random_output_len=10)
    first = make_dataset(spec, 20, seed=3, maker=WORD_MAKER)
    assert make_dataset(spec, 20, seed=3, maker=WORD_MAKER) == first
    assert make_dataset(spec, 20, seed=4, maker=WORD_MAKER) != first
    assert make_dataset(spec, 5, seed=3, maker=WORD_MAKER) == first[:5]  # drawn one by one
    assert {(s.prompt_len, s.output_len) for s in first} == {(40, 10)}
    assert all(len(s.prompt.split()) == 40 and s.ignore_eos for s in first)
    assert all(word in WORDS for s in first for word in s.prompt.split())

    ranged = DatasetSpec(random_input_len=40, random_output_len=10, random_range_ratio=0.5)
    samples = make_dataset(ranged, 400, seed=0, maker=WORD_MAKER)
    inputs = [s.prompt_len for s in samples]
    outputs = [s.output_len for s in samples]
    assert min(inputs) >= 20 and max(inputs) <= 60 and len(set(inputs)) > 20
    assert min(outputs) >= 5 and max(outputs) <= 15


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


def test_token_exact_prompts_with_a_tokenizer(tokenizer):
    spec = DatasetSpec(random_input_len=33, random_output_len=7)
    samples = make_dataset(spec, 10, seed=0, maker=PromptMaker(tokenizer, endpoint_takes_ids=True))
    special = set(tokenizer.all_special_ids)
    for sample in samples:
        assert isinstance(sample.prompt, list) and len(sample.prompt) == sample.prompt_len == 33
        assert all(isinstance(t, int) and 0 <= t < len(tokenizer) for t in sample.prompt)
        assert not special & set(sample.prompt)
    assert len({tuple(s.prompt) for s in samples}) == 10
    # Chat takes text: the same tokens, decoded.
    chat = make_dataset(spec, 10, seed=0, maker=PromptMaker(tokenizer, endpoint_takes_ids=False))
    assert [c.prompt for c in chat] == [tokenizer.decode(s.prompt) for s in samples]


def test_sharegpt_like_lengths_are_seeded_long_tailed_and_clipped():
    spec = DatasetSpec(
        name="sharegpt-like", sharegpt_input_mean=100, sharegpt_output_mean=50, sharegpt_max_len=400
    )
    samples = make_dataset(spec, 3000, seed=1, maker=WORD_MAKER)
    assert make_dataset(spec, 50, seed=1, maker=WORD_MAKER) == samples[:50]
    inputs = np.array([s.prompt_len for s in samples])
    outputs = np.array([s.output_len for s in samples])
    assert inputs.min() >= 4 and inputs.max() <= 400 and outputs.max() <= 400
    assert (inputs == 400).any()  # the tail reached the clip
    # Lognormal with sigma 1: the mean sits well above the median (a long right tail).
    assert np.median(inputs) < 0.75 * inputs.mean()
    assert 85 < inputs.mean() < 110 and 43 < outputs.mean() < 57
    assert all(len(s.prompt.split()) == s.prompt_len for s in samples[:100])


def test_prefix_groups_share_their_prefix(tokenizer):
    spec = DatasetSpec(name="prefix", prefix_len=24, num_prefix_groups=3, random_input_len=8)
    samples = make_dataset(spec, 12, seed=0, maker=PromptMaker(tokenizer, endpoint_takes_ids=True))
    assert all(len(s.prompt) == s.prompt_len == 32 for s in samples)
    prefixes = [tuple(s.prompt[:24]) for s in samples]
    assert len(set(prefixes)) == 3
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [4, 4, 4]
    assert len({tuple(s.prompt[24:]) for s in samples}) == 12  # every suffix is its own
    assert prefixes != sorted(prefixes)  # groups are interleaved, not back to back
    words = make_dataset(spec, 6, seed=0, maker=WORD_MAKER)
    assert len({" ".join(s.prompt.split()[:24]) for s in words}) == 3


def test_jsonl_is_read_in_order_and_cycled(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "one two three", "max_tokens": 5},
        {"prompt": [1, 2, 3, 4], "max_tokens": 9},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    spec = DatasetSpec(name="jsonl", dataset_path=str(path))
    samples = make_dataset(spec, 5, seed=0, maker=WORD_MAKER)
    assert [s.prompt for s in samples] == ["one two three", [1, 2, 3, 4]] * 2 + ["one two three"]
    assert [(s.prompt_len, s.output_len) for s in samples[:2]] == [(3, 5), (4, 9)]
    assert not any(s.ignore_eos for s in samples)  # a real dataset ends where the model ends
    with pytest.raises(ValueError, match="completions"):
        make_dataset(spec, 2, seed=0, maker=PromptMaker(None, endpoint_takes_ids=False))
    path.write_text(json.dumps({"prompt": "no length"}) + "\n")
    with pytest.raises(ValueError, match="max_tokens"):
        make_dataset(spec, 1, seed=0, maker=WORD_MAKER)
