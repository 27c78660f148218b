"""SamplingParams validation: every bad value gives a message naming it; good values pass."""

from __future__ import annotations

import math

import msgspec
import pytest

from conveyor.protocol import SamplingParams
from conveyor.protocol.sampling_params import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    find_sampling_problem,
    find_vocab_problem,
)

BAD_VALUES = [
    ({"n": 0}, "n must be between 1 and 16, got 0"),
    ({"n": MAX_N + 1}, "n must be between 1 and 16, got 17"),
    ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
    ({"temperature": math.nan}, "temperature must be a finite number >= 0"),
    ({"temperature": math.inf}, "temperature must be a finite number >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_p": math.nan}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -1}, r"top_k must be >= 0 \(0 disables it\), got -1"),
    ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
    ({"min_p": 1.01}, r"min_p must be in \[0, 1\]"),
    ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
    ({"max_tokens": -5}, "max_tokens must be at least 1, got -5"),
    ({"min_tokens": -1}, "min_tokens must be >= 0, got -1"),
    ({"min_tokens": 5, "max_tokens": 4}, r"min_tokens \(5\) must not exceed max_tokens \(4\)"),
    ({"stop": ["ok", ""]}, "stop strings must be non-empty"),
    ({"stop_token_ids": [3, -1]}, "stop_token_ids must be non-negative token ids"),
    ({"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop must hold at most 16 strings, got 17"),
    (
        {"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))},
        "stop_token_ids must hold at most 256 distinct ids, got 257",
    ),
    ({"logprobs": -1}, "logprobs must be >= 0, got -1"),
    ({"prompt_logprobs": -2}, "prompt_logprobs must be >= 0, got -2"),
    ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\], got 2.5"),
    ({"frequency_penalty": -2.01}, r"frequency_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": math.nan}, r"frequency_penalty must be in \[-2, 2\]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0, got 0.0"),
    ({"repetition_penalty": math.inf}, "repetition_penalty must be > 0"),
    ({"seed": 2**63}, "seed must fit in a signed 64-bit integer"),
    ({"seed": -(2**63) - 1}, "seed must fit in a signed 64-bit integer"),
]

GOOD_VALUES = [
    {},
    {"temperature": 0.0},
    {"n": MAX_N, "temperature": 1.5, "top_p": 1.0, "top_k": 50, "min_p": 1.0},
    {"top_p": 1e-6, "min_p": 0.0},
    {"max_tokens": None, "min_tokens": 1000},
    {"max_tokens": 1, "min_tokens": 1},
    {"stop": ["\n", "###"], "stop_token_ids": [0, 151643], "include_stop_str_in_output": True},
    {"logprobs": 0},
    {"logprobs": MAX_LOGPROBS},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0, "repetition_penalty": 1.3},
    {"seed": 2**63 - 1},
    {"seed": -(2**63), "ignore_eos": True},
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_VALUES, ids=lambda v: str(v)[:80])
def test_bad_value_is_rejected_with_a_clear_message(kwargs: dict, message: str):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


# msgpack cannot carry an int below -2**63 at all, so that case never reaches the decoder.
WIRE_BAD_VALUES = [case for case in BAD_VALUES if case[0].get("seed", 0) >= -(2**63)]


@pytest.mark.parametrize(("kwargs", "message"), WIRE_BAD_VALUES, ids=lambda v: str(v)[:80])
def test_bad_value_arriving_on_the_wire_is_a_validation_error(kwargs: dict, message: str):
    frame = msgspec.msgpack.encode(kwargs)
    with pytest.raises(msgspec.ValidationError, match=message):
        msgspec.msgpack.decode(frame, type=SamplingParams)


@pytest.mark.parametrize("kwargs", GOOD_VALUES, ids=lambda v: str(v)[:80])
def test_good_values_are_accepted_and_survive_the_wire(kwargs: dict):
    params = SamplingParams(**kwargs)
    assert find_sampling_problem(params) is None
    for name, value in kwargs.items():
        expected = frozenset(value) if name == "stop_token_ids" else value
        assert getattr(params, name) == expected
    frame = msgspec.msgpack.encode(params)
    assert msgspec.msgpack.decode(frame, type=SamplingParams) == params


def test_stop_token_ids_are_a_frozenset_here_and_after_the_wire():
    # The engine looks every sampled token up in it.
    params = SamplingParams(stop_token_ids=[7, 3, 7], stop=["s"] * MAX_STOP_STRINGS)
    assert params.stop_token_ids == frozenset({3, 7})
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded == params and isinstance(decoded.stop_token_ids, frozenset)
    assert len(SamplingParams(stop_token_ids=range(MAX_STOP_TOKEN_IDS)).stop_token_ids) == 256


def test_greedy_means_temperature_zero():
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=1e-3).is_greedy


def test_defaults_are_omitted_on_the_wire():
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(SamplingParams())) == {}
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(SamplingParams(top_k=5))) == {"top_k": 5}
    assert msgspec.msgpack.decode(msgspec.msgpack.encode({}), type=SamplingParams) == (
        SamplingParams()
    )


def test_params_are_frozen():
    params = SamplingParams()
    with pytest.raises(AttributeError):
        params.temperature = 0.0  # type: ignore[misc]


def test_the_servers_logprobs_cap_is_checked_with_the_model():
    """The cap is the server's (--max-logprobs, vLLM's 20 by default), checked where the model
    is known: by the frontend and again by the engine."""
    many = SamplingParams(logprobs=MAX_LOGPROBS + 1, prompt_logprobs=MAX_LOGPROBS + 1)
    assert (
        find_vocab_problem(many, 1000) == "logprobs must be between 0 and 20 (max_logprobs), got 21"
    )
    assert find_vocab_problem(many, 1000, max_logprobs=1000) is None
    prompt_only = SamplingParams(prompt_logprobs=30)
    assert find_vocab_problem(prompt_only, 1000, 25).startswith("prompt_logprobs must be between")
