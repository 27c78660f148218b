"""Request: counters, and when check_stop ends a request and why."""

from __future__ import annotations

import pytest

from conveyor.engine_core import Request, RequestStatus
from conveyor.protocol import SamplingParams

EOS = 2


def make_request(prompt_len: int = 4, max_model_len: int = 100, **params: object) -> Request:
    return Request(
        0,
        list(range(10, 10 + prompt_len)),
        SamplingParams(**params),  # type: ignore[arg-type]
        max_model_len=max_model_len,
        eos_token_ids=(EOS,),
    )


def feed(request: Request, tokens: list[int]) -> list[bool]:
    """Append tokens one at a time as the scheduler does; check_stop's answer after each."""
    stops = []
    for token in tokens:
        request.append_output_token_id(token)
        stops.append(request.check_stop())
    return stops


def test_counters_track_prompt_and_outputs():
    request = make_request(prompt_len=5)
    assert (request.num_tokens, request.num_prompt_tokens, request.num_output_tokens) == (5, 5, 0)
    feed(request, [7, 8])
    assert request.num_tokens == 7
    assert request.output_token_ids == [7, 8]
    assert request.prompt_token_ids == [10, 11, 12, 13, 14]
    assert request.status is RequestStatus.WAITING and request.num_cached_tokens == -1


def test_eos_stops_with_reason_stop_and_no_stop_reason():
    request = make_request(max_tokens=10)
    assert feed(request, [5, EOS]) == [False, True]
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert request.status.finish_reason == "stop" and request.stop_reason is None
    assert request.is_finished


def test_ignore_eos_runs_on_to_max_tokens():
    request = make_request(max_tokens=3, ignore_eos=True)
    assert feed(request, [EOS, EOS, EOS]) == [False, False, True]
    assert request.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert request.status.finish_reason == "length"


def test_stop_token_ids_stop_and_name_the_token_even_with_ignore_eos():
    request = make_request(max_tokens=10, stop_token_ids=[42], ignore_eos=True)
    assert feed(request, [EOS, 42]) == [False, True]
    assert request.status is RequestStatus.FINISHED_STOPPED and request.stop_reason == 42


def test_min_tokens_suppresses_eos_and_stop_tokens_until_reached():
    request = make_request(max_tokens=10, min_tokens=3, stop_token_ids=[42])
    assert feed(request, [EOS, 42, EOS]) == [False, False, True]
    assert request.num_output_tokens == 3


def test_max_tokens_caps_with_reason_length():
    request = make_request(max_tokens=2)
    assert feed(request, [5, 6]) == [False, True]
    assert request.status is RequestStatus.FINISHED_LENGTH_CAPPED


def test_stop_token_on_the_last_allowed_token_reports_stop():
    request = make_request(max_tokens=2)
    assert feed(request, [5, EOS]) == [False, True]
    assert request.status is RequestStatus.FINISHED_STOPPED


@pytest.mark.parametrize("max_tokens", [None, 50])
def test_max_model_len_caps_outputs(max_tokens: int | None):
    request = make_request(prompt_len=8, max_model_len=11, max_tokens=max_tokens)
    assert request.max_tokens == 3
    assert feed(request, [5, 6, 7]) == [False, False, True]
    assert request.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert request.num_tokens == 11


def test_finished_statuses_and_reasons():
    assert not RequestStatus.PREEMPTED.is_finished
    assert RequestStatus.FINISHED_ABORTED.finish_reason == "abort"
    assert RequestStatus.FINISHED_ERROR.finish_reason == "error"
    assert RequestStatus.RUNNING.finish_reason is None
