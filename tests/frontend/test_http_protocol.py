"""The HTTP frontend's pure parts, without a server: body decoding and checks, streamed text
with stop strings and stop tokens (and the offline API's), and the Prometheus text.

Runs in the test process, in milliseconds (the tokenizer is the tiny model's).
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.frontend.output_processor import (
    MAX_DECODE_TOKENS_ON_LOOP,
    ChoiceState,
    OutputProcessor,
)
from conveyor.frontend.server.errors import MAX_MESSAGE_CHARS, ApiError
from conveyor.frontend.server.request_models import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_max_tokens,
    chat_num_logprobs,
    chat_template_variables,
    check_completion_request,
    decode_body,
    message_text,
    prompt_list,
    to_sampling_params,
)
from conveyor.frontend.tokenizer import load_tokenizer
from conveyor.protocol import EngineCoreOutput, Logprobs, SamplingParams
from conveyor.protocol.sampling_params import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)

VOCAB_SIZE = 2048


def _convert_completion(raw: bytes) -> None:
    body = decode_body(raw, CompletionRequest)
    check_completion_request(body)
    prompt_list(body.prompt)
    to_sampling_params(body, body.max_tokens, body.logprobs, VOCAB_SIZE)


def _convert_chat(raw: bytes) -> None:
    body = decode_body(raw, ChatCompletionRequest)
    num_logprobs = chat_num_logprobs(body)
    for i, message in enumerate(body.messages):
        message_text(message, i)
    to_sampling_params(body, chat_max_tokens(body, {}), num_logprobs, VOCAB_SIZE)
    chat_template_variables(body)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
COMPLETION_FIELDS = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop",
                     "stop_token_ids", "logprobs", "min_tokens", "stream_options", "model", "echo",
                     "priority", "presence_penalty", "logit_bias", "best_of", "allowed_token_ids",
                     "truncate_prompt_tokens", "response_format", "user", "metadata",
                     "skip_special_tokens", "request_id", "stream_interval", "use_beam_search",
                     "bad_words", "truncation_side", "add_special_tokens"]  # fmt: skip
CHAT_FIELDS = ["messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs",
               "temperature", "n", "tools", "response_format", "stop", "chat_template_kwargs",
               "add_generation_prompt", "tool_choice", "logit_bias", "reasoning_effort",
               "continue_final_message", "documents", "echo", "chat_template", "modalities",
               "service_tier", "prediction"]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(COMPLETION_FIELDS), json_values, max_size=5))
def test_any_completion_body_is_accepted_or_a_bounded_400(fields: dict[str, Any]):
    body = {"prompt": "def f():", **fields}
    try:
        _convert_completion(json.dumps(body).encode())
    except ApiError as error:
        assert error.status == 400 and len(error.message) < 4 * MAX_MESSAGE_CHARS


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(CHAT_FIELDS), json_values, max_size=5))
def test_any_chat_body_is_accepted_or_a_400(fields: dict[str, Any]):
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    try:
        _convert_chat(json.dumps(body).encode())
    except ApiError as error:
        assert error.status == 400


@given(st.binary(max_size=64))
def test_any_bytes_are_a_body_or_a_400(raw: bytes):
    try:
        _convert_completion(raw)
    except ApiError as error:
        assert error.status == 400


def test_invalid_utf8_inside_a_string_is_a_400_not_a_crash():
    # Found by tests/frontend/test_http_fuzz.py: msgspec raised UnicodeDecodeError (a 500).
    with pytest.raises(ApiError, match="not valid UTF-8") as error:
        _convert_completion(b'{"prompt": "def \x85ain():", "max_tokens": 2}')
    assert error.value.status == 400


def test_a_deeply_nested_body_is_a_400_not_a_crash():
    nested = b"[" * 100_000 + b"]" * 100_000
    raw = b'{"messages": [], "chat_template_kwargs": {"x": ' + nested + b"}}"
    with pytest.raises(ApiError, match="nested too deeply"):
        _convert_chat(raw)
    # A field nobody knows is refused by its name before its value is even parsed.
    with pytest.raises(ApiError, match="unknown field 'unknown'") as error:
        _convert_completion(b'{"prompt": "x", "unknown": ' + nested + b"}")
    assert (error.value.status, error.value.param) == (400, "unknown")


def test_the_sampling_error_names_its_field():
    body = decode_body(b'{"prompt": "x", "top_p": 0}', CompletionRequest)
    with pytest.raises(ApiError) as error:
        to_sampling_params(body, 16, None, VOCAB_SIZE)
    assert error.value.param == "top_p" and "top_p" in error.value.message


def test_the_four_prompt_forms_and_the_mixed_one():
    assert prompt_list("a") == ["a"]
    assert prompt_list(["a", "b"]) == ["a", "b"]
    assert prompt_list([1, 2]) == [[1, 2]]
    assert prompt_list([[1], [2, 3]]) == [[1], [2, 3]]
    with pytest.raises(ApiError):
        prompt_list([[1], "a"])


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


def _run_tracker(tokenizer: Any, text: str, stop: list[str]) -> tuple[ChoiceState, list[str]]:
    """Feed ``text``'s tokens one engine output at a time; the text deltas handed out."""
    token_ids = list(tokenizer(text).input_ids)
    params = SamplingParams(stop=stop, max_tokens=len(token_ids))
    tracker = ChoiceState(0, "r", tokenizer, [5, 6], params, 0.0, stream=True)
    deltas = []
    for i, token_id in enumerate(token_ids):
        last = i == len(token_ids) - 1
        output = EngineCoreOutput("r", [token_id], "length" if last else None)
        deltas.append(tracker.update(output).text)
        if tracker.finished:
            break
    return tracker, deltas


def test_streamed_text_never_shows_a_stop_string_or_its_start(tokenizer):
    text = "x = compute(1)\nreturn value_of_x + 1\n# trailing words"
    tracker, deltas = _run_tracker(tokenizer, text, ["return value", "never"])
    assert "".join(deltas) == "x = compute(1)\n" == tracker.text
    assert (tracker.finish_reason, tracker.stop_reason) == ("stop", "return value")
    assert len(deltas) < len(tokenizer(text).input_ids), "it stopped at the stop string"


def test_without_a_stop_the_deltas_add_up_to_the_whole_decode(tokenizer):
    text = "def main():\n    print('héllo wörld ✓')\n"
    tracker, deltas = _run_tracker(tokenizer, text, [])
    whole = tokenizer.decode(tracker.token_ids, skip_special_tokens=True)
    assert "".join(deltas) == whole and tracker.finish_reason == "length"


def test_a_long_choice_is_decoded_off_the_event_loop_with_the_same_text(tokenizer):
    """Row 18: the whole-text decode of a long choice's last output runs in ``run_cpu`` (a
    thread), short ones stay on the loop; both give what ``process_output`` gives."""
    token_ids = list(tokenizer("def f(x):\n    return x + 1\n" * 200).input_ids)
    assert len(token_ids) > MAX_DECODE_TOKENS_ON_LOOP
    loop_thread = threading.get_ident()
    decoded_in: list[int] = []

    async def run_cpu(function: Any, *args: Any) -> Any:
        def call() -> Any:
            decoded_in.append(threading.get_ident())
            return function(*args)

        return await asyncio.to_thread(call)

    async def fold_all(length: int) -> tuple[str, list[str]]:
        params = SamplingParams(max_tokens=length)
        whole = OutputProcessor([ChoiceState(0, "a", tokenizer, [5], params, 0.0, stream=False)])
        streamed = ChoiceState(0, "b", tokenizer, [5], params, 0.0, stream=True)
        deltas = []
        for i, token_id in enumerate(token_ids[:length]):
            reason = "length" if i == length - 1 else None
            delta = await whole.process_output_off_loop(
                EngineCoreOutput("a", [token_id], reason), run_cpu
            )
            assert delta is not None
            deltas.append(delta.text)
            streamed.update(EngineCoreOutput("b", [token_id], reason))
        assert whole.num_unfinished == 0
        return "".join(deltas), [streamed.text]

    text, (streamed_text,) = asyncio.run(fold_all(20))
    assert text == streamed_text and decoded_in == [], "a short choice is decoded on the loop"
    text, (streamed_text,) = asyncio.run(fold_all(len(token_ids)))
    assert text == streamed_text == tokenizer.decode(token_ids, skip_special_tokens=True)
    assert len(decoded_in) == 1 and decoded_in[0] != loop_thread


def test_skip_special_tokens_decides_whether_they_show(tokenizer):
    """vLLM's detokenizing options, streamed and decoded whole (the offline API's path)."""
    token_ids = [1, *tokenizer("x = 1").input_ids, 1]  # 1: <|im_start|>, not an EOS
    for options, expected in (
        ({}, "x = 1"),
        ({"skip_special_tokens": False}, "<|im_start|>x = 1<|im_start|>"),
        # A fast tokenizer writes no spaces between special tokens either way.
        ({"skip_special_tokens": False, "spaces_between_special_tokens": False},
         "<|im_start|>x = 1<|im_start|>"),
    ):  # fmt: skip
        params = SamplingParams(max_tokens=len(token_ids), **options)
        for stream in (True, False):
            state = ChoiceState(0, "r", tokenizer, [5], params, 0.0, stream=stream)
            for i, token_id in enumerate(token_ids):
                last = i == len(token_ids) - 1
                state.update(EngineCoreOutput("r", [token_id], "length" if last else None))
            assert state.text == expected, (options, stream)


# ---------------------------------------------------------------- stop tokens


def _stopped_by_token(
    tokenizer: Any, include: bool = False, **params: Any
) -> tuple[SamplingParams, list[int], list[EngineCoreOutput]]:
    """Engine outputs of "x = compute(1) return" whose last token is a stop token id."""
    token_ids = list(tokenizer("x = compute(1) return").input_ids)
    stop_id = token_ids[-1]  # " return": an ordinary word, so its text would show
    sampling = SamplingParams(stop_token_ids=[stop_id], include_stop_str_in_output=include,
                              max_tokens=32, **params)  # fmt: skip
    outputs = [EngineCoreOutput("r", [t], logprobs=Logprobs([[t]], [[-0.5]], [1]))
               for t in token_ids]  # fmt: skip
    outputs[-1].finish_reason, outputs[-1].stop_reason = "stop", stop_id
    return sampling, token_ids, outputs


@pytest.mark.parametrize("stop", [[], ["never"]], ids=["no-stop-strings", "stop-strings"])
def test_a_stop_token_leaves_its_text_out_but_counts_as_generated(tokenizer, stop):
    params, token_ids, outputs = _stopped_by_token(tokenizer, stop=stop)
    tracker = ChoiceState(0, "r", tokenizer, [5, 6], params, 0.0, stream=True)
    deltas = [tracker.update(output) for output in outputs]
    expected = tokenizer.decode(token_ids[:-1], skip_special_tokens=True)
    assert "".join(d.text for d in deltas) == tracker.text == expected == "x = compute(1)"
    assert (tracker.finish_reason, tracker.stop_reason) == ("stop", token_ids[-1])
    # The token ids, usage and logprobs still hold it: it was sampled.
    assert tracker.token_ids == token_ids and len(tracker.logprobs) == len(token_ids)
    assert deltas[-1].token_ids == [token_ids[-1]] and deltas[-1].logprobs

    offline = ChoiceState(
        0, "r", tokenizer, [5, 6], msgspec.structs.replace(params, logprobs=0), 0.0, stream=False
    )
    for output in outputs:
        offline.update(output)
    completion = offline.to_completion_output()
    assert completion.text == expected and completion.token_ids == token_ids
    assert (completion.finish_reason, completion.stop_reason) == ("stop", token_ids[-1])
    assert len(completion.logprobs) == len(token_ids)


def test_include_stop_str_in_output_keeps_the_stop_tokens_text(tokenizer):
    params, token_ids, outputs = _stopped_by_token(tokenizer, include=True)
    tracker = ChoiceState(0, "r", tokenizer, [5, 6], params, 0.0, stream=True)
    streamed = "".join(tracker.update(output).text for output in outputs)
    assert streamed == tracker.text == "x = compute(1) return"
    offline = ChoiceState(0, "r", tokenizer, [5, 6], params, 0.0, stream=False)
    for output in outputs:
        offline.update(output)
    assert offline.to_completion_output().text == "x = compute(1) return"


# ---------------------------------------------------------------- stop limits, nulls, stream


def test_stop_strings_and_stop_token_ids_are_capped():
    def convert(**fields: Any) -> None:
        _convert_completion(json.dumps({"prompt": "x", **fields}).encode())

    convert(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)])
    convert(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)))
    with pytest.raises(ApiError, match="at most 16") as error:
        convert(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])
    assert (error.value.status, error.value.param) == (400, "stop")
    with pytest.raises(ApiError, match="at most 256") as error:
        convert(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))
    assert (error.value.status, error.value.param) == (400, "stop_token_ids")
    # Counted as sent: repeating one id does not get past the cap either.
    with pytest.raises(ApiError, match="at most 256"):
        convert(stop_token_ids=[3] * (MAX_STOP_TOKEN_IDS + 1))
    # A stream holds back the longest stop string's length: a long one made it a whole response.
    convert(stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS)
    for stop in ("x" * (MAX_STOP_STRING_CHARS + 1), ["\n", "x" * 400_000]):
        with pytest.raises(ApiError, match="at most 256 characters each") as error:
            convert(stop=stop)
        assert (error.value.status, error.value.param) == (400, "stop")
    with pytest.raises(ValueError, match="stop strings may hold at most 256 characters"):
        SamplingParams(stop=["x" * (MAX_STOP_STRING_CHARS + 1)])


def test_null_means_the_default_for_what_openai_clients_send_as_null():
    body = decode_body(
        b'{"prompt": "x", "n": null, "stream": null, "echo": null, "logprobs": null}',
        CompletionRequest,
    )
    assert (body.n, body.stream, body.echo, body.logprobs) == (1, False, False, None)
    check_completion_request(body)
    assert to_sampling_params(body, 16, body.logprobs, VOCAB_SIZE).n == 1
    chat = decode_body(
        b'{"messages": [{"role": "user", "content": "hi"}], "n": null, "stream": null,'
        b' "logprobs": null, "top_logprobs": null}',
        ChatCompletionRequest,
    )
    assert (chat.n, chat.stream, chat.logprobs) == (1, False, False)
    assert chat_num_logprobs(chat) is None


@pytest.mark.parametrize("body_type", [CompletionRequest, ChatCompletionRequest])
def test_stream_options_need_stream_true(body_type):
    if body_type is CompletionRequest:
        fields: dict[str, Any] = {"prompt": "x"}
    else:
        fields = {"messages": [{"role": "user", "content": "hi"}]}
    options = {"stream_options": {"include_usage": True}}
    for stream in ({}, {"stream": False}, {"stream": None}):
        body = decode_body(json.dumps({**fields, **options, **stream}).encode(), body_type)
        with pytest.raises(ApiError, match="stream: true") as error:
            to_sampling_params(body, 16, None, VOCAB_SIZE)
        assert (error.value.status, error.value.param) == (400, "stream_options")
    for ok in ({**options, "stream": True}, {"stream_options": None}):
        body = decode_body(json.dumps({**fields, **ok}).encode(), body_type)
        to_sampling_params(body, 16, None, VOCAB_SIZE)
