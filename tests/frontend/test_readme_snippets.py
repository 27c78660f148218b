"""The README's structured-output and tool-call snippet, run exactly as printed against a real
server on the embedded default model, and the tool calls LangChain and LiteLLM make.

Runs in the test process against ``conveyor serve`` (no model argument: the default model).
The snippet is taken from README.md's text, so an edit there is what runs here; it reads
``client`` and ``model`` from the block before it, which the test provides. Each run adds a
different ``seed`` to every request (in the client's transport, not the snippet), so ten runs
sample ten different outputs: a random-weight-like model has to finish every one of them.

These failed before object schemas were strict: the parameters' schema let the model open a key
of its own (``additionalProperties`` defaults to any key) and write it until max_tokens, so
``tool_calls`` was None (README's ``TypeError`` on ``tool_calls[0]``, LangChain's empty
``tool_calls``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from conveyor.frontend.engine_args import DEFAULT_MODEL_DIR
from tests.frontend.http_helpers import ServedHttp, start_served_http

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("readme-snippets")]

README = Path(__file__).resolve().parents[2] / "README.md"
SEEDS = range(10)


def readme_snippet(after: str) -> str:
    """The first python block of README.md after the line ``after``."""
    text = README.read_text()
    start = text.index(after)
    match = re.search(r"```python\n(.*?)```", text[start:], re.DOTALL)
    assert match is not None
    return match.group(1)


class SeededTransport(httpx.HTTPTransport):
    """Adds ``seed`` to every JSON request body."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.seed = seed

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.content:
            body = json.loads(request.content)
            body["seed"] = self.seed
            content = json.dumps(body).encode()
            headers = {k: v for k, v in request.headers.items() if k.lower() != "content-length"}
            request = httpx.Request(request.method, request.url, headers=headers, content=content)
        return super().handle_request(request)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedHttp]:
    folder = tmp_path_factory.mktemp("readme")
    extra = ["--frontends", "1", "--disable-metrics"]
    served = start_served_http(DEFAULT_MODEL_DIR, folder / "serve.log", extra)
    try:
        yield served
    finally:
        served.stop()


def _client(served: ServedHttp, seed: int) -> openai.OpenAI:
    http_client = httpx.Client(transport=SeededTransport(seed))
    return openai.OpenAI(
        base_url=f"{served.base_url}/v1", api_key="none", http_client=http_client, max_retries=0
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_the_readme_structured_output_and_tool_snippet_runs_as_printed(served, seed):
    snippet = readme_snippet("Structured outputs and tool calls, with the same client:")
    client = _client(served, seed)
    scope: dict[str, Any] = {"client": client, "model": client.models.list().data[0].id}
    exec(compile(snippet, "README.md", "exec"), scope)
    assert type(scope["ticket"]).__name__ == "Ticket" and 1 <= scope["ticket"].priority <= 5
    call = scope["call"]
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}


WEATHER_TOOL_DOC = "Get the current weather in a city."


def test_langchain_bind_tools_gets_a_call_from_the_default_model(served):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Annotated[str, Field(max_length=20)]) -> str:
        """Get the current weather in a city."""
        return "sunny"

    class GetTime(BaseModel):
        """Get the time in a city."""

        city: str = Field(max_length=20)  # bounded: a small model may never close a string

    for seed in SEEDS:
        llm = ChatOpenAI(
            base_url=f"{served.base_url}/v1",
            api_key="none",
            model="tiny",
            max_tokens=100,
            seed=seed,
            max_retries=0,
        )
        # bind_tools as LangChain's with_structured_output uses it: the tool named.
        message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather?")
        assert [c["name"] for c in message.tool_calls] == ["get_weather"], message
        assert set(message.tool_calls[0]["args"]) == {"city"}
        # "any" is OpenAI's required.
        message = llm.bind_tools([GetTime], tool_choice="any").invoke("Time in Paris?")
        assert message.tool_calls and message.tool_calls[0]["name"] == "GetTime", message
        assert set(message.tool_calls[0]["args"]) == {"city"}


def test_litellm_completion_with_tools_gets_a_call(served, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": WEATHER_TOOL_DOC,
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 20}},
                    "required": ["city"],
                },
            },
        }
    ]
    for seed in SEEDS:
        response = litellm.completion(
            model="openai/tiny",
            api_base=f"{served.base_url}/v1",
            api_key="none",
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=tools,
            tool_choice="required",
            max_tokens=100,
            seed=seed,
        )
        calls = response.choices[0].message.tool_calls
        assert calls and calls[0].function.name == "get_weather"
        assert set(json.loads(calls[0].function.arguments)) == {"city"}
