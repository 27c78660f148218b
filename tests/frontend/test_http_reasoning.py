"""Reasoning parsers on real servers: the tiny gpt-oss model with gpt-oss's own chat template
(harmony) and the tiny Qwen3 model with Qwen3's, through the ``openai`` client.

Runs in the test process against ``conveyor serve``. A random-weight model writes no harmony
headers or ``</think>`` of its own, so what these show is the pipeline around the parsers: the
template renders tools and reasoning_effort, a streamed answer splits exactly as the whole one,
a constraint applies from the first token when the template closed the reasoning in the prompt
(enable_thinking false), and an answer that never ends its reasoning is all reasoning, its
tokens counted as reasoning tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.frontend.http_helpers import MODEL_NAME, start_served_http

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("http-reasoning")]

TEMPLATES = Path(__file__).parent / "chat_templates"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12, "description": "The city."}},
        "required": ["city"]}}}]  # fmt: skip


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    from benchmarks.fixtures.model_maker import ensure_model

    folder = tmp_path_factory.mktemp("gpt-oss")
    flags = ["--frontends", "1", "--disable-metrics", "--chat-template",
             str(TEMPLATES / "gpt_oss.jinja"), "--reasoning-parser", "openai_gptoss",
             "--tool-call-parser", "openai", "--enable-auto-tool-choice"]  # fmt: skip
    served = start_served_http(ensure_model("tiny", "gpt_oss"), folder / "serve.log", flags)
    try:
        yield openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="x", max_retries=0)
    finally:
        served.stop()


@pytest.fixture(scope="module")
def qwen3(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[openai.OpenAI]:
    folder = tmp_path_factory.mktemp("qwen3")
    flags = ["--frontends", "1", "--disable-metrics", "--chat-template",
             str(TEMPLATES / "qwen3.jinja"), "--reasoning-parser", "qwen3"]  # fmt: skip
    served = start_served_http(tiny_model_dir, folder / "serve.log", flags)
    try:
        yield openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="x", max_retries=0)
    finally:
        served.stop()


def _joined(stream) -> tuple[str, str, str | None]:
    reasoning, content, finish = "", "", None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            reasoning += delta.get("reasoning") or ""
            content += delta.get("content") or ""
            finish = choice.finish_reason or finish
    return reasoning, content, finish


def test_gpt_oss_renders_its_template_and_splits_alike_whole_and_streamed(gpt_oss):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    kwargs = dict(model=MODEL_NAME, messages=messages, tools=TOOLS, max_tokens=24, seed=3,
                  reasoning_effort="low", extra_body={"return_prompt_text": True})  # fmt: skip
    whole = gpt_oss.chat.completions.create(**kwargs)
    prompt = whole.model_extra["prompt_text"]
    assert "Reasoning: low" in prompt and "type get_weather = (_: {" in prompt
    assert prompt.endswith("<|start|>assistant")
    message = whole.choices[0].message
    reasoning = (message.model_extra or {}).get("reasoning") or ""
    streamed = _joined(gpt_oss.chat.completions.create(**kwargs, stream=True))
    assert streamed == (reasoning, message.content or "", whole.choices[0].finish_reason)
    assert whole.usage.completion_tokens == 24


def test_qwen3_thinking_off_constrains_from_the_first_token(qwen3):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}},
              "required": ["n"]}  # fmt: skip
    for seed in range(3):
        response = qwen3.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "A number?"}],
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
            max_tokens=20,
            seed=seed,
        )
        message = response.choices[0].message
        assert set(json.loads(message.content)) == {"n"}
        assert not (message.model_extra or {}).get("reasoning")
        assert response.usage.completion_tokens_details.reasoning_tokens == 0


def test_qwen3_an_answer_that_never_ends_its_reasoning_is_all_reasoning(qwen3):
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=16,
                  seed=1)  # fmt: skip
    whole = qwen3.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    reasoning = message.model_extra["reasoning"]
    assert reasoning and message.content is None and whole.choices[0].finish_reason == "length"
    # Every token but those of a "<think>" it may have written.
    assert whole.usage.completion_tokens_details.reasoning_tokens >= 14
    assert _joined(qwen3.chat.completions.create(**kwargs, stream=True)) == (
        reasoning,
        "",
        "length",
    )
