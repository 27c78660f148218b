"""``--enable-log-requests`` lines stay small whatever the request, and say what matters.

Runs in the test process, in milliseconds (the tokenizer is the tiny model's). The line of a
real server under such a request: tests/frontend/test_http_metrics.py.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from conveyor.frontend.input_processor import Choice
from conveyor.frontend.output_processor import ChoiceState
from conveyor.frontend.server.request_log import (
    MAX_MESSAGE_BYTES,
    RequestLogger,
    cut_line,
    grammar_shown,
    shown,
)
from conveyor.frontend.tokenizer import load_tokenizer
from conveyor.protocol import EngineCoreRequest, SamplingParams
from conveyor.protocol.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_GRAMMAR_CHARS,
    MAX_STOP_STRING_CHARS,
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


def _choices(tokenizer: Any, prompts: list[list[int]], params: SamplingParams) -> list[Choice]:
    return [
        Choice(
            EngineCoreRequest(f"r-{i}", prompt, params, 0.0),
            ChoiceState(i, f"r-{i}", tokenizer, prompt, params, 0.0, stream=False),
        )
        for i, prompt in enumerate(prompts)
    ]


def _logged(logger: RequestLogger, choices: list[Choice], caplog: Any) -> list[str]:
    """The arrival and finish lines, the arrival made as the server makes it."""
    calls: list[str] = []

    async def run_cpu(function: Any, *args: Any) -> Any:
        calls.append(function.__name__)
        return function(*args)

    with caplog.at_level(logging.INFO, logger="conveyor.frontend.requests"):
        asyncio.run(logger.arrived("cmpl-1", choices, 1, run_cpu))
        logger.finished("cmpl-1", choices)
    return [record.getMessage() for record in caplog.records] + calls


_GRAMMAR_START, _GRAMMAR_END = (
    '{"grammars":[{"name":"json_schema","json_schema":{"enum":["',
    '"]}}]}',
)
GRAMMAR = _GRAMMAR_START + "x" * (MAX_GRAMMAR_CHARS - 100) + _GRAMMAR_END
HUGE = SamplingParams(
    temperature=0.5,
    stop=["\u00e9" * MAX_STOP_STRING_CHARS] * 16,
    allowed_token_ids=list(range(2048)) * (MAX_ALLOWED_TOKEN_IDS // 2048),
    logit_bias={i: 1.0 for i in range(300)},
    stop_token_ids=list(range(256)),
    grammar=GRAMMAR,
)


def test_a_request_with_every_parameter_at_its_cap_logs_lines_within_8_kib(tokenizer, caplog):
    prompts = [list(range(4096))] * 256
    logger = RequestLogger(tokenizer, log_prompts=True)
    arrival, finish, *off_loop = _logged(logger, _choices(tokenizer, prompts, HUGE), caplog)
    for line in (arrival, finish):
        assert len(line.encode()) <= MAX_MESSAGE_BYTES
    # A grammar by kind, size and hash; lists and dicts by their first items and their size.
    assert f"'grammar': <json_schema grammar, {len(GRAMMAR)} chars, blake2b " in arrival
    assert f"...({MAX_ALLOWED_TOKEN_IDS} items)" in arrival and "...(300 items)" in arrival
    assert f"...({MAX_STOP_STRING_CHARS} chars)" in arrival and "'temperature': 0.5" in arrival
    assert "256 prompt(s) of 4096, 4096" in arrival and f"...({256 * 4096} in all)" in arrival
    assert "(first 4 of 256 prompts)" in arrival
    assert "finished: unfinished x256, 0 tokens generated" in finish
    # Hashing a megabyte and decoding prompts are left to the CPU pool.
    assert off_loop == ["arrival_line"]


def test_a_small_request_is_logged_in_full_on_the_loop(tokenizer, caplog):
    params = SamplingParams(temperature=0.0, stop=["\n\n"], ignore_eos=True)
    arrival, finish, *off_loop = _logged(RequestLogger(tokenizer), _choices(tokenizer, [[5, 6]], params), caplog)  # fmt: skip
    assert arrival == (
        "request cmpl-1: 1 prompt(s) of 2 tokens, params {'temperature': 0.0, "
        "'stop': ['\\n\\n'], 'ignore_eos': True, 'n': 1}"
    )
    assert finish.startswith("request cmpl-1 finished: unfinished, 0 tokens generated, TTFT none")
    assert off_loop == []


def test_values_are_cut_before_they_are_formatted():
    assert shown("ab") == "'ab'"
    assert shown("a" * 1000) == repr("a" * 64) + "...(1000 chars)"
    assert shown(list(range(100))) == "[0, 1, 2, 3, 4, 5, 6, 7, ...(100 items)]"
    assert shown({"k": [[["deep"]]]}) == "{'k': [<list of 1>]}"
    assert shown(10**200).endswith("...") and len(shown(10**200)) == 67
    same, other = grammar_shown("start: /a+/"), grammar_shown("start: /b+/")
    assert same.startswith("<lark grammar, 11 chars, blake2b ") and same != other
    # Cut by UTF-8 bytes, never inside a character.
    line = cut_line("\u20ac" * 10_000)
    assert len(line.encode()) <= MAX_MESSAGE_BYTES and line.endswith(" ...(line cut)")
    assert set(line.removesuffix(" ...(line cut)")) == {"\u20ac"}
