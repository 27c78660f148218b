"""The load generator's prompts: random, sharegpt-like, prefix groups, or a JSONL file.

Runs in the load generator's process (conveyor bench serve). Every dataset is seeded, so the same
arguments give the same requests. Lengths are exact in tokens when a local Hugging Face tokenizer
is given and the endpoint is /v1/completions (the prompt is sent as a token-id list, which the
server does not re-tokenize). Without a tokenizer prompts are made of common English words, one
word standing for one token, so input lengths are approximate; through /v1/chat/completions the
chat template adds tokens too. Output lengths are exact either way when the server honours
``ignore_eos`` (the synthetic datasets send it) and ``max_tokens``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

DATASETS = ("random", "sharegpt-like", "prefix", "jsonl")

# Words that are one token (with their leading space) in the common BPE vocabularies, so a
# prompt of N words is close to N tokens when no tokenizer is given.
_WORD_TEXT = (
    "the of and to in is was for on that with as by at from his her are be this an which or "
    "had not but have it they were one all their she there been has when who more would two "
    "time if about into after first other out new some than then only over its also these up "
    "people may most years many world such city made used where state can three during most "
    "under known year like part while between later each both through against him them four "
    "team music work film name well early war life long house game group high water since "
    "place school small family before good great back until never last still five every "
    "found day same large just went home side river light church power road book number"
)
WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class SampleRequest:
    """One request to send: its prompt, and the lengths the benchmark expects."""

    prompt: str | list[int]  # a token-id list only for /v1/completions with a tokenizer
    prompt_len: int  # tokens (exact with a tokenizer on completions, else approximate)
    output_len: int  # sent as max_tokens
    ignore_eos: bool


@dataclass(frozen=True)
class DatasetSpec:
    """Everything the datasets read from the command line."""

    name: str = "random"
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    # sharegpt-like: lognormal lengths with these means (the PagedAttention paper reports
    # about 161 prompt and 338 output tokens for ShareGPT) and this sigma of the underlying
    # normal (1.0 gives the long right tail of real chat logs), clipped to [min_len, max_len].
    sharegpt_input_mean: float = 161.0
    sharegpt_output_mean: float = 338.0
    sharegpt_sigma: float = 1.0
    sharegpt_min_len: int = 4
    sharegpt_max_len: int = 2048
    prefix_len: int = 512
    num_prefix_groups: int = 4
    dataset_path: str | None = None
    ignore_eos: bool | None = None  # None: True for the synthetic datasets, False for jsonl


class PromptMaker:
    """Turns random token units into a prompt: token ids with a tokenizer, words without."""

    def __init__(self, tokenizer: Any | None, endpoint_takes_ids: bool) -> None:
        self.tokenizer = tokenizer
        self.endpoint_takes_ids = endpoint_takes_ids
        # Chat messages are text, so token ids are decoded; their length then drifts.
        self.as_token_ids = endpoint_takes_ids and tokenizer is not None
        if tokenizer is not None:
            # Special tokens (BOS, EOS, chat markers) would change how the server reads the
            # prompt, so random prompts draw from the ordinary vocabulary only.
            vocab = np.arange(len(tokenizer))
            self._ids = vocab[~np.isin(vocab, list(tokenizer.all_special_ids))]

    def units(self, rng: np.random.Generator, length: int) -> list[Any]:
        """``length`` random tokens (ids) or words."""
        if self.tokenizer is not None:
            return rng.choice(self._ids, size=length).tolist()
        return [WORDS[i] for i in rng.integers(0, len(WORDS), size=length)]

    def render(self, units: list[Any]) -> str | list[int]:
        if self.as_token_ids:
            return [int(u) for u in units]
        if self.tokenizer is not None:
            return self.tokenizer.decode(units)
        return " ".join(units)


def sample_lengths(rng: np.random.Generator, mean: int, range_ratio: float, num: int) -> np.ndarray:
    """Uniform in [mean * (1 - r), mean * (1 + r)], at least 1 (vLLM's --random-range-ratio)."""
    low = max(1, round(mean * (1 - range_ratio)))
    high = max(low, round(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=num)


def lognormal_lengths(
    rng: np.random.Generator, mean: float, sigma: float, bounds: tuple[int, int], num: int
) -> np.ndarray:
    """Long-tailed lengths: lognormal with the given mean, clipped to ``bounds``."""
    mu = np.log(mean) - sigma**2 / 2  # so that E[exp(N(mu, sigma))] == mean
    lengths = np.rint(rng.lognormal(mu, sigma, size=num)).astype(int)
    return np.clip(lengths, bounds[0], bounds[1])


def make_dataset(
    spec: DatasetSpec, num_requests: int, seed: int, maker: PromptMaker
) -> list[SampleRequest]:
    """``num_requests`` requests of the named dataset, the same ones for the same seed.

    random and sharegpt-like draw request by request, so the first N requests are the same
    whatever the total (more warm-ups or prompts do not reshuffle the others).
    """
    rng = np.random.default_rng(seed)
    if spec.name in ("random", "sharegpt-like"):
        ignore_eos = True if spec.ignore_eos is None else spec.ignore_eos
        samples = []
        for _ in range(num_requests):
            num_in, num_out = _lengths(rng, spec)
            prompt = maker.render(maker.units(rng, num_in))
            samples.append(SampleRequest(prompt, num_in, num_out, ignore_eos))
        return samples
    if spec.name == "prefix":
        return _prefix_groups(rng, maker, spec, num_requests)
    if spec.name == "jsonl":
        return _jsonl(spec, num_requests, maker)
    raise ValueError(f"unknown dataset {spec.name!r}; choose one of {', '.join(DATASETS)}")


def _lengths(rng: np.random.Generator, spec: DatasetSpec) -> tuple[int, int]:
    """One request's (input, output) lengths."""
    if spec.name == "random":
        num_in = sample_lengths(rng, spec.random_input_len, spec.random_range_ratio, 1)[0]
        num_out = sample_lengths(rng, spec.random_output_len, spec.random_range_ratio, 1)[0]
    else:
        bounds = (spec.sharegpt_min_len, spec.sharegpt_max_len)
        sigma = spec.sharegpt_sigma
        num_in = lognormal_lengths(rng, spec.sharegpt_input_mean, sigma, bounds, 1)[0]
        num_out = lognormal_lengths(rng, spec.sharegpt_output_mean, sigma, bounds, 1)[0]
    return int(num_in), int(num_out)


def _prefix_groups(
    rng: np.random.Generator, maker: PromptMaker, spec: DatasetSpec, num_requests: int
) -> list[SampleRequest]:
    """Each prompt: its group's shared prefix, then a unique random suffix of random-input-len.

    Groups are dealt round-robin and the order shuffled, so requests of one group arrive spread
    over the run the way a shared system prompt does, not back to back.
    """
    if spec.num_prefix_groups < 1:
        raise ValueError("--num-prefix-groups must be at least 1")
    prefixes = [maker.units(rng, spec.prefix_len) for _ in range(spec.num_prefix_groups)]
    groups = rng.permutation(np.arange(num_requests) % spec.num_prefix_groups)
    suffix_lens = sample_lengths(rng, spec.random_input_len, spec.random_range_ratio, num_requests)
    output_lens = sample_lengths(rng, spec.random_output_len, spec.random_range_ratio, num_requests)
    ignore_eos = True if spec.ignore_eos is None else spec.ignore_eos
    samples = []
    for group, n_suffix, n_out in zip(groups, suffix_lens, output_lens):
        units = prefixes[group] + maker.units(rng, int(n_suffix))
        samples.append(SampleRequest(maker.render(units), len(units), int(n_out), ignore_eos))
    return samples


def _jsonl(spec: DatasetSpec, num_requests: int, maker: PromptMaker) -> list[SampleRequest]:
    """One ``{"prompt": str | [ids], "max_tokens": int}`` per line, cycled to ``num_requests``."""
    if not spec.dataset_path:
        raise ValueError("the jsonl dataset needs --dataset-path")
    records = []
    with Path(spec.dataset_path).open() as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if "prompt" not in record or "max_tokens" not in record:
                raise ValueError(f"{spec.dataset_path}:{number}: needs 'prompt' and 'max_tokens'")
            records.append(record)
    if not records:
        raise ValueError(f"{spec.dataset_path} holds no prompts")
    ignore_eos = False if spec.ignore_eos is None else spec.ignore_eos
    return [
        _jsonl_sample(records[i % len(records)], maker, ignore_eos) for i in range(num_requests)
    ]


def _jsonl_sample(record: dict[str, Any], maker: PromptMaker, ignore_eos: bool) -> SampleRequest:
    prompt = record["prompt"]
    if isinstance(prompt, list):
        prompt_len = len(prompt)
        if not maker.endpoint_takes_ids:
            if maker.tokenizer is None:
                raise ValueError("token-id prompts need --endpoint completions or --tokenizer")
            prompt = maker.tokenizer.decode(prompt)
    elif maker.tokenizer is not None:
        prompt_len = len(maker.tokenizer.encode(prompt, add_special_tokens=False))
    else:
        prompt_len = len(prompt.split())
    return SampleRequest(prompt, prompt_len, int(record["max_tokens"]), ignore_eos)


def load_tokenizer(path: str) -> Any:
    """A local Hugging Face tokenizer directory; nothing is downloaded."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
