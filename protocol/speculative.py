"""Speculative decoding's configuration: vLLM's ``--speculative-config`` JSON, checked.

Shared by every process (the engine core schedules the drafts, the workers propose and verify
them). Standard library and msgspec only.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

# The proposers a request's drafts can come from (worker/spec_decode/proposers.py registers the
# implementations; the names are vLLM's).
SPEC_METHODS: tuple[str, ...] = ("ngram", "draft_model")
# vLLM's keys that conveyor reads; any other key is refused by name, never ignored.
_KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "disable_by_batch_size",
    "model",
    "quantization",
)
# Keys only one method reads: given to the other, they would be silently meaningless.
_DRAFT_ONLY_KEYS = ("model", "quantization")
_NGRAM_ONLY_KEYS = ("prompt_lookup_max", "prompt_lookup_min")
# Above this many running requests a step carries no drafts: verification's extra positions
# cost more than the tokens they win once the step is no longer bound by reading the weights.
# Measured on 2 shared CPU cores (`conveyor bench offline --compare-spec`): on a copying workload
# ngram paid at 1 and 4 running requests in every run and was mixed from 16 on; 8 sits between.
# A draft model that costs about what the target does loses at every batch size, which no
# threshold fixes. Not yet measured where a GPU step stops being weight-bound.
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
# ngram's lookup lengths when the config names neither (vLLM's).
DEFAULT_PROMPT_LOOKUP = 5
# The longest a request whose drafts keep failing goes without them (its steps): the engine core
# schedules none meanwhile, and a draft model's worker proposes none.
MAX_BACKOFF_STEPS = 32


class SpeculativeConfig(msgspec.Struct, frozen=True):
    method: str = "ngram"
    # Draft tokens proposed per request per step (k): a step verifies 1 + k positions.
    num_speculative_tokens: int = 4
    # ngram: the longest and shortest suffix of the request's tokens looked up in its history
    # (vLLM's defaults: 5 and 5 when neither is given, one given stands for both).
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    # No drafts in a step when more requests than this run (vLLM's key, conveyor's rule:
    # counted at each step, not only for new requests).
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    # draft_model: the draft's Hugging Face directory (resolved to a local path by the
    # frontend; same vocabulary as the target), and its weights' format, as --quantization
    # takes it (e.g. "int8"/"int4" made at load time on CPU); None: as the checkpoint has them.
    model: str | None = None
    quantization: str | None = None

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a running request needs past its scheduled tokens for the proposer: a draft
        model writes its own KV at the positions of the drafts it makes (the last draft's never),
        so after the next token it needs k - 1 more; the first of them is reserved with it."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0


def parse_speculative_config(value: str | dict[str, Any] | None) -> SpeculativeConfig | None:
    """vLLM's JSON (a string or a dict) -> a checked config; ValueError naming what is wrong."""
    if value is None or value == "" or value == {}:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"--speculative-config is not JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError("--speculative-config must be a JSON object")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ValueError(
            f"--speculative-config: conveyor does not implement {', '.join(unknown)} "
            f"(it reads {', '.join(_KEYS)})"
        )
    method = value.get("method")
    if method is None and value.get("model") is not None:
        # vLLM's inference: a model without a method is a draft model.
        method = value["method"] = "draft_model"
    if method not in SPEC_METHODS:
        raise ValueError(
            f"--speculative-config: method {method!r} is not implemented; conveyor has "
            f"{', '.join(SPEC_METHODS)}"
        )
    if method == "ngram":
        # As vLLM reads them: one length given stands for the other too, so the same JSON looks
        # up the same n-grams in both engines.
        shortest, longest = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        value = {
            **value,
            "prompt_lookup_min": shortest if shortest is not None else longest,
            "prompt_lookup_max": longest if longest is not None else shortest,
        }
        if shortest is None and longest is None:
            value["prompt_lookup_min"] = value["prompt_lookup_max"] = DEFAULT_PROMPT_LOOKUP
    try:
        config = msgspec.convert(value, SpeculativeConfig)
    except msgspec.ValidationError as error:
        raise ValueError(f"--speculative-config: {error}") from None
    misplaced = [
        key
        for key in (_NGRAM_ONLY_KEYS if method == "draft_model" else _DRAFT_ONLY_KEYS)
        if key in value
    ]
    if misplaced:
        raise ValueError(
            f"--speculative-config: method {method!r} does not read {', '.join(misplaced)}"
        )
    check_speculative_config(config)
    return config


def check_speculative_config(config: SpeculativeConfig) -> None:
    if not 1 <= config.num_speculative_tokens <= 32:
        raise ValueError("--speculative-config: num_speculative_tokens must be in [1, 32]")
    if not 1 <= config.prompt_lookup_min <= config.prompt_lookup_max:
        raise ValueError("--speculative-config: need 1 <= prompt_lookup_min <= prompt_lookup_max")
    if config.disable_by_batch_size < 1:
        raise ValueError("--speculative-config: disable_by_batch_size must be at least 1")
    if config.method == "draft_model" and not config.model:
        raise ValueError('--speculative-config: method "draft_model" needs "model": the draft')
