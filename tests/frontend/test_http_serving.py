"""The generation handlers against a scripted engine client: what a stream sends first, and the
checks a request meets before anything reaches the engine.

Runs in the test process, in milliseconds: the engine client is a stand-in that plays back
outputs (or fails), the tokenizer is the tiny model's.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from tokenizers.processors import TemplateProcessing

from conveyor.frontend.engine_client.session import EngineDeadError
from conveyor.frontend.server.chat import create_chat_completion
from conveyor.frontend.server.completions import create_completion
from conveyor.frontend.server.errors import ApiError
from conveyor.frontend.server.request_models import (
    ChatCompletionRequest,
    CompletionRequest,
    decode_body,
)
from conveyor.frontend.server.serving import ServingState, check_prompts
from conveyor.frontend.tokenizer import load_tokenizer
from conveyor.protocol import (
    CacheConfig,
    EngineConfig,
    EngineCoreOutput,
    EngineCoreRequest,
    ModelConfig,
    SchedulerConfig,
)

# One request's outputs, or the error its stream raises after them.
Script = Callable[[EngineCoreRequest], list[EngineCoreOutput | BaseException]]


class ScriptedEngineClient:
    """Plays back a script per request, as ``AsyncEngineClient`` streams outputs."""

    def __init__(self, config: EngineConfig, script: Script) -> None:
        self.config = config
        self._script = script
        self.aborted: list[str] = []

    async def add_request(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        return self._play(self._script(request))

    async def _play(
        self, items: list[EngineCoreOutput | BaseException]
    ) -> AsyncIterator[EngineCoreOutput]:
        for item in items:
            if isinstance(item, BaseException):
                raise item
            yield item

    def abort_nowait(self, request_ids: list[str]) -> None:
        self.aborted += request_ids


def _config(
    model_dir: Path,
    max_model_len: int = 4096,
    scheduler_len: int = 4096,
    num_blocks: int | None = None,
) -> EngineConfig:
    model = ModelConfig(str(model_dir), "Qwen3ForCausalLM", 2048, max_model_len, (2, 0))
    return EngineConfig(
        model,
        cache=CacheConfig(block_size=16, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_model_len=scheduler_len),
    )


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


def _state(tokenizer: Any, config: EngineConfig, script: Script | None = None) -> ServingState:
    client = ScriptedEngineClient(config, script or (lambda request: []))
    # No metrics: prometheus_client's multiprocess mode needs a process of its own
    # (tests/frontend/test_metrics.py).
    return ServingState(client, tokenizer, "tiny", None, 1 << 20)  # type: ignore[arg-type]


async def _never_disconnects() -> dict[str, Any]:
    await asyncio.Event().wait()
    return {}


def _chat_events(state: ServingState, **fields: Any) -> list[Any]:
    """The SSE payloads of a streamed chat completion ("[DONE]" as a string)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, **fields}
    return _stream_events(state, create_chat_completion, ChatCompletionRequest, body)


def _completion_events(state: ServingState, **fields: Any) -> list[Any]:
    body = {"prompt": "hi", "stream": True, **fields}
    return _stream_events(state, create_completion, CompletionRequest, body)


def _stream_events(state: ServingState, handler: Any, body_type: Any, body: Any) -> list[Any]:
    async def run() -> list[bytes]:
        request = decode_body(json.dumps(body).encode(), body_type)
        response = await handler(state, request, _never_disconnects)
        return [chunk async for chunk in response.body_iterator]

    events = b"".join(asyncio.run(run())).decode().split("\n\n")
    payloads = [e.removeprefix("data: ") for e in events if e]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


TEXT = "x = compute(1)"


def _text_outputs(request: EngineCoreRequest, tokenizer: Any) -> list[Any]:
    """``TEXT`` one token per output, ending at the length limit."""
    outputs = [EngineCoreOutput(request.request_id, [i]) for i in tokenizer(TEXT).input_ids]
    outputs[-1].finish_reason = "length"
    return outputs


def test_a_chat_stream_whose_request_fails_before_any_output_sends_no_role(
    tiny_model_dir, tokenizer
):
    def script(request: EngineCoreRequest) -> list[Any]:
        return [EngineCoreOutput(request.request_id, [], "error", "needs more KV cache blocks")]

    events = _chat_events(_state(tokenizer, _config(tiny_model_dir), script))
    assert events[-1] == "[DONE]"
    assert [set(e) for e in events[:-1]] == [{"error"}], events
    assert events[0]["error"]["code"] == 500


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_stream_starts_only_once_the_engine_answered(tiny_model_dir, tokenizer, endpoint):
    """No header before the engine's first output: a request it refuses is a 429 and a dead
    engine a 503 (the app's handler for EngineDeadError), never a 200 stream."""

    def refused(request: EngineCoreRequest) -> list[Any]:
        reason = "the engine's queue is full (2 requests waiting); retry later"
        return [EngineCoreOutput(request.request_id, [], "rejected", reason)]

    def dead(request: EngineCoreRequest) -> list[Any]:
        return [EngineDeadError("the engine process exited")]

    stream = _chat_events if endpoint == "chat" else _completion_events
    with pytest.raises(ApiError) as refusal:
        stream(_state(tokenizer, _config(tiny_model_dir), refused))
    assert refusal.value.status == 429 and refusal.value.retry_after_s == 1
    assert "queue is full" in refusal.value.message
    with pytest.raises(EngineDeadError):
        stream(_state(tokenizer, _config(tiny_model_dir), dead))


def test_each_chat_choice_gets_its_role_with_its_first_output(tiny_model_dir, tokenizer):
    def script(request: EngineCoreRequest) -> list[Any]:
        return _text_outputs(request, tokenizer)

    events = _chat_events(_state(tokenizer, _config(tiny_model_dir), script), n=2)
    assert events[-1] == "[DONE]"
    choices = [c for e in events[:-1] for c in e["choices"]]
    for index in (0, 1):
        deltas = [c["delta"] for c in choices if c["index"] == index]
        assert deltas[0] == {"role": "assistant", "content": "x"}
        assert all("role" not in d for d in deltas[1:])
        assert "".join(d.get("content") or "" for d in deltas) == TEXT


# ---------------------------------------------------------------- checks before the engine


def test_a_request_larger_than_the_whole_kv_pool_is_a_400(tiny_model_dir, tokenizer):
    # 9 blocks of 16 tokens, block 0 reserved: 8 usable, 128 tokens.
    state = _state(tokenizer, _config(tiny_model_dir, num_blocks=9))
    prompt = list(range(10, 110))  # 100 tokens
    check_prompts(state, [prompt], 28)  # exactly 128
    check_prompts(state, [prompt], None)  # until the context is full: may end early (EOS)
    with pytest.raises(ApiError, match="KV cache") as error:
        check_prompts(state, [prompt], 29)
    assert (error.value.status, error.value.param) == (400, "max_tokens")
    with pytest.raises(ApiError, match="KV cache"):
        check_prompts(state, [list(range(10, 139))], None)  # the prompt alone is too big
    # An engine that did not say how big its pool is decides for itself.
    check_prompts(_state(tokenizer, _config(tiny_model_dir)), [prompt], 3000)


def test_the_context_limit_is_the_smaller_of_the_models_and_the_schedulers(
    tiny_model_dir, tokenizer
):
    for config in (
        _config(tiny_model_dir, max_model_len=4096, scheduler_len=256),
        _config(tiny_model_dir, max_model_len=256, scheduler_len=256),
    ):
        state = _state(tokenizer, config)
        check_prompts(state, [list(range(10, 110))], 156)
        with pytest.raises(ApiError, match="maximum context length is 256") as error:
            check_prompts(state, [list(range(10, 110))], 157)
        assert error.value.status == 400
        with pytest.raises(ApiError, match="max_model_len is 256"):
            check_prompts(state, [list(range(256))], 1)


# ---------------------------------------------------------------- client-controlled nesting


def _chat_whole(state: ServingState, **fields: Any) -> Any:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}

    async def run() -> Any:
        request = decode_body(json.dumps(body).encode(), ChatCompletionRequest)
        return await create_chat_completion(state, request, _never_disconnects)

    response = asyncio.run(run())
    assert response.status_code == 200
    return json.loads(response.body)


@pytest.mark.parametrize(
    "constraint",
    [
        {"json": '{"type": "array", "items": ' * 5000 + "{}" + "}" * 5000},
        {"grammar": "root ::= " + "(" * 400 + '"a"' + ")" * 400},
        {"grammar": "root ::= ("},
    ],
    ids=["schema text 5000 deep", "gbnf 400 deep", "gbnf unclosed"],
)
def test_a_constraint_its_parser_gives_up_on_is_a_400_naming_it(
    tiny_model_dir, tokenizer, constraint
):
    # Python's JSON parser and llguidance's GBNF converter raise RecursionError or a plain
    # ValueError: each was a 500.
    state = _state(tokenizer, _config(tiny_model_dir))
    for stream in (_chat_events, lambda s, **f: _chat_whole(s, **f)):
        with pytest.raises(ApiError) as error:
            stream(state, structured_outputs=constraint, max_tokens=4)
        assert (error.value.status, error.value.param) == (400, "structured_outputs")


def test_a_tool_call_nested_past_the_parser_is_content_whole_and_streamed(
    tiny_model_dir, tokenizer
):
    depth = 1100
    text = '<tool_call>{"name": "f", "arguments": {"a": ' + "[" * depth + "]" * depth + "}}"
    text += "</tool_call>"
    token_ids = tokenizer(text, add_special_tokens=False).input_ids

    def script(request: EngineCoreRequest) -> list[Any]:
        outputs = [
            EngineCoreOutput(request.request_id, token_ids[i : i + 64])
            for i in range(0, len(token_ids), 64)
        ]
        outputs[-1].finish_reason = "length"
        return outputs

    config = _config(tiny_model_dir)
    config = msgspec.structs.replace(
        config, model=msgspec.structs.replace(config.model, tool_call_parser="hermes")
    )
    state = _state(tokenizer, config, script)
    # tool_choice "auto" and a constraint go together: the grammar may force such a call.
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    regex = re.escape(text)
    fields = {"tools": tools, "tool_choice": "auto", "structured_outputs": {"regex": regex}}
    whole = _chat_whole(state, max_tokens=len(token_ids), **fields)
    message = whole["choices"][0]["message"]
    assert (message["content"], message.get("tool_calls")) == (text, None)
    events = _chat_events(state, max_tokens=len(token_ids), **fields)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    deltas = [c["delta"] for e in events[:-1] for c in e["choices"]]
    # A stream sends a call's name and arguments as they are written, so this one went out
    # before its end showed it too deep to read; never an error, and nothing of it is content.
    calls = [call for d in deltas for call in d.get("tool_calls") or []]
    assert [call["function"]["name"] for call in calls if "name" in call["function"]] == ["f"]
    arguments = "".join(call["function"].get("arguments", "") for call in calls)
    assert text.startswith('<tool_call>{"name": "f", "arguments": ' + arguments)
    assert not "".join(d.get("content") or "" for d in deltas)


def test_a_stream_that_fails_in_the_frontend_does_not_blame_the_engine(tiny_model_dir, tokenizer):
    def failing(error: BaseException) -> Script:
        return lambda request: [EngineCoreOutput(request.request_id, [5]), error]

    events = _chat_events(_state(tokenizer, _config(tiny_model_dir), failing(KeyError("x"))))
    assert events[-2]["error"]["code"] == 500
    assert events[-2]["error"]["message"] == "internal error: KeyError"
    dead = failing(EngineDeadError("the engine process exited"))
    events = _chat_events(_state(tokenizer, _config(tiny_model_dir), dead))
    assert events[-2]["error"]["code"] == 503
    assert events[-2]["error"]["message"] == "the engine failed: the engine process exited"


# ---------------------------------------------------------------- vLLM's request fields


def _with_bos(tokenizer: Any) -> Any:
    """The tiny tokenizer, made to add a BOS (<|endoftext|>) as Llama's add one."""
    with_bos = copy.deepcopy(tokenizer)
    with_bos.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    return with_bos


def test_add_special_tokens_decides_the_bos_as_in_vllm(tiny_model_dir, tokenizer):
    """Completions add the tokenizer's special tokens unless told not to; chat does not (its
    template wrote them) unless told to."""
    prompts: list[list[int]] = []

    def script(request: EngineCoreRequest) -> list[Any]:
        prompts.append(request.prompt_token_ids)
        return _text_outputs(request, tokenizer)

    state = _state(_with_bos(tokenizer), _config(tiny_model_dir), script)
    for fields in ({}, {"add_special_tokens": False}):
        _completion_events(state, **fields)
    for fields in ({}, {"add_special_tokens": True}):
        _chat_events(state, **fields)
    plain = list(tokenizer("hi").input_ids)
    assert prompts[:2] == [[0, *plain], plain]
    templated = prompts[2]
    assert templated[0] != 0 and prompts[3] == [0, *templated]


def test_stream_interval_and_continuous_usage_shape_the_chunks(tiny_model_dir, tokenizer):
    """``TEXT`` is 8 tokens: with stream_interval 3 each choice sends 1 (the first token at
    once), 3, 3 and the last 1; every chunk carries its choice's usage so far."""
    state = _state(tokenizer, _config(tiny_model_dir), lambda r: _text_outputs(r, tokenizer))
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = _completion_events(state, n=2, stream_interval=3, stream_options=options)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 16
    for index in (0, 1):
        chunks = [e for e in events[:-2] if e["choices"][0]["index"] == index]
        used = [c["usage"]["completion_tokens"] for c in chunks]
        assert used == [1, 4, 7, 8] and all(c["usage"]["prompt_tokens"] == 1 for c in chunks)
        assert "".join(c["choices"][0]["text"] for c in chunks) == TEXT
    # Continuous usage needs include_usage (vLLM's rule); without either, no usage at all.
    for options in ({"continuous_usage_stats": True}, {"include_usage": False}):
        events = _chat_events(state, stream_options=options)
        assert all(e["usage"] is None for e in events[:-1])


def test_a_continued_message_keeps_its_role_and_echo_repeats_it(tiny_model_dir, tokenizer):
    state = _state(tokenizer, _config(tiny_model_dir), lambda r: _text_outputs(r, tokenizer))
    said = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}]
    continued = {"messages": said, "add_generation_prompt": False, "continue_final_message": True}
    whole = _chat_whole(state, echo=True, **continued)
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "Once" + TEXT}
    events = _chat_events(state, echo=True, **continued)
    deltas = [c["delta"] for e in events[:-1] for c in e["choices"]]
    assert deltas[0]["role"] == "assistant" and deltas[0]["content"].startswith("Once")
    assert "".join(d["content"] for d in deltas) == "Once" + TEXT
    # Without a generation prompt the answer goes on in the last message's role (vLLM's);
    # echo repeats only a message of that role.
    plain = _chat_whole(state, echo=True, add_generation_prompt=False)
    assert plain["choices"][0]["message"] == {"role": "user", "content": "hi" + TEXT}
    answer = _chat_whole(state, echo=True, messages=[{"role": "user", "content": "hi"}])
    assert answer["choices"][0]["message"]["content"] == TEXT
