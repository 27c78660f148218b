"""Engine outputs that carry several tokens (speculative decoding's accepted runs): the choice
ends where one token at a time would have ended it, stop strings included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conveyor.frontend.output_processor import ChoiceState
from conveyor.frontend.tokenizer import load_tokenizer
from conveyor.protocol import EngineCoreOutput, Logprobs, SamplingParams

TEXT = "def main():\n    return 42\n\nprint(main())\n"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


def _rows(token_ids: list[int]) -> Logprobs:
    return Logprobs(
        token_ids=[[t] for t in token_ids],
        logprobs=[[-0.5] for _ in token_ids],
        ranks=[1 for _ in token_ids],
    )


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("run", [1, 3, 5])
def test_a_stop_string_inside_a_run_ends_the_choice_at_its_token(tokenizer, stream, run) -> None:
    token_ids = list(tokenizer(TEXT).input_ids)
    params = SamplingParams(stop=["return"], max_tokens=len(token_ids), logprobs=0)
    one = ChoiceState(0, "a", tokenizer, [5], params, 0.0, stream=stream)
    for token_id in token_ids:
        one.update(EngineCoreOutput("a", [token_id], logprobs=_rows([token_id])))
        if one.finished:
            break
    several = ChoiceState(0, "b", tokenizer, [5], params, 0.0, stream=stream)
    streamed_ids = []
    for start in range(0, len(token_ids), run):
        chunk = token_ids[start : start + run]
        delta = several.update(EngineCoreOutput("b", chunk, logprobs=_rows(chunk)))
        streamed_ids += delta.token_ids
        if several.finished:
            break
    assert one.stop_reason == several.stop_reason == "return"
    assert several.token_ids == one.token_ids
    assert streamed_ids == one.token_ids
    assert len(several.logprobs) == len(one.logprobs) == len(one.token_ids)
    assert several.text == one.text == "def main():\n    "
