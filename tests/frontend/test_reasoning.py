"""Reasoning parsers: each family's output split into reasoning and content, whole and streamed
at every split point, and through the chat handler with the family's real chat template.

Runs in the test process, in seconds. The parsers are checked on texts as the families write
them (the splits vLLM's parsers of the same names give); the handler tests render prompts with
the real templates (``tests/frontend/chat_templates/``) and play scripted outputs back one token
per engine step, so every token boundary is a split of the stream.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from llguidance import LLMatcher

from conveyor.frontend.parsers.output_split import ChoiceSplit, split_output
from conveyor.frontend.parsers.reasoning import REASONING_PARSERS, reasoning_parser
from conveyor.frontend.server.chat import create_chat_completion
from conveyor.frontend.server.request_models import ChatCompletionRequest, decode_body
from conveyor.frontend.server.serving import ServingState
from conveyor.frontend.structured_outputs import GrammarChecker, after_reasoning, grammar_of
from conveyor.frontend.tokenizer import load_tokenizer
from conveyor.protocol import (
    CacheConfig,
    EngineConfig,
    EngineCoreOutput,
    EngineCoreRequest,
    ModelConfig,
    SchedulerConfig,
    StructuredOutputsParams,
)
from tests.frontend.test_http_serving import ScriptedEngineClient

TEMPLATES = Path(__file__).parent / "chat_templates"
QWEN3_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
HARMONY = "<|channel|>analysis<|message|>Think first.<|end|><|start|>assistant"
HARMONY += "<|channel|>final<|message|>The answer."

# (parser, template variables, prompt's end, output, reasoning, content) as vLLM splits them.
CASES = [
    ("qwen3", {}, QWEN3_PROMPT, "<think>\nLet me see.\n</think>\n\nIt is 4.", "\nLet me see.\n",
     "\n\nIt is 4."),
    # Newer templates open the reasoning in the prompt: only </think> is written.
    ("qwen3", {}, QWEN3_PROMPT + "<think>\n", "Let me see.</think>It is 4.", "Let me see.",
     "It is 4."),
    # Cut off while thinking: all reasoning.
    ("qwen3", {}, QWEN3_PROMPT, "<think>\nStill thinking", "\nStill thinking", None),
    # Thinking off: the template closed the reasoning in the prompt; all content.
    ("qwen3", {"enable_thinking": False}, QWEN3_PROMPT + "<think>\n\n</think>\n\n", "It is 4.",
     None, "It is 4."),
    ("deepseek_r1", {}, "<｜Assistant｜><think>\n", "Hmm, 2+2.\n</think>\n\n4", "Hmm, 2+2.\n",
     "\n\n4"),
    ("deepseek_r1", {}, "<｜Assistant｜>", "<think>Hmm.</think>4", "Hmm.", "4"),
    ("deepseek_v3", {}, "<｜Assistant｜></think>", "4, no thinking</think> here",
     None, "4, no thinking</think> here"),
    ("deepseek_v3", {"thinking": True}, "<｜Assistant｜><think>", "Hmm.</think>4", "Hmm.", "4"),
    ("mistral", {}, "[INST]Hi[/INST]", "[THINK]Hmm.[/THINK]4", "Hmm.", "4"),
    ("mistral", {}, "[INST]Hi[/INST]", "Just 4.", None, "Just 4."),
    ("granite", {"thinking": True}, "<|start_of_role|>assistant<|end_of_role|>",
     "Here is my thought process: 2+2. Here is my response: 4", " 2+2. ", " 4"),
    ("granite", {"thinking": True}, "", "Here's my thought process:x Here's my response:y", "x ",
     "y"),
    ("granite", {}, "", "Here is my response: 4", None, "Here is my response: 4"),
    ("openai_gptoss", {}, "<|start|>assistant", HARMONY, "Think first.", "The answer."),
    ("openai_gptoss", {}, "<|start|>assistant", "<|channel|>analysis<|message|>Cut",
     "Cut", None),
]  # fmt: skip


@pytest.mark.parametrize(("name", "kwargs", "prompt", "text", "reasoning", "content"), CASES)
def test_each_format_splits_whole_and_streamed_at_every_split(
    name, kwargs, prompt, text, reasoning, content
):
    parser = reasoning_parser(name, kwargs, prompt)
    whole = split_output(text, parser, None)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    for cuts in [[i] for i in range(len(text))] + [list(range(len(text)))]:
        stream = ChoiceSplit(reasoning_parser(name, kwargs, prompt), None)
        thought, answer, start = "", "", 0
        for end in [c for c in cuts if c > 0] + [len(text)]:
            piece = stream.feed(text[start:end], done=end == len(text))
            thought, answer, start = thought + piece.reasoning, answer + piece.content, end
        assert (thought, answer) == (reasoning or "", content or ""), cuts


def test_every_registered_name_makes_a_parser():
    for name in REASONING_PARSERS:
        assert reasoning_parser(name, {}, "").split("", done=True) == ("", "")


# ---------------------------------------------------------------- grammars after the reasoning


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


def _accepts(checker: GrammarChecker, tokenizer: Any, grammar: str, text: str) -> bool:
    matcher = LLMatcher(checker.ll_tokenizer(), grammar)
    for token in tokenizer(text, add_special_tokens=False).input_ids:
        if not matcher.consume_token(token):
            return False
    return matcher.is_accepting()


@pytest.mark.parametrize(
    ("name", "kwargs", "reasoning"),
    [
        ("qwen3", {}, "<think>\nAny {text} at all\n</think>\n\n"),
        ("deepseek_r1", {}, "Any {text}</think>"),
        ("mistral", {}, "[THINK]Any {text}[/THINK]"),
        ("granite", {"thinking": True}, "Here is my thought process: {x} Here is my response: "),
        ("openai_gptoss", {}, "<|channel|>analysis<|message|>{x}<|end|><|start|>assistant"
         "<|channel|>final<|message|>"),
    ],
)  # fmt: skip
def test_a_constraint_applies_after_the_end_of_the_reasoning(tokenizer, name, kwargs, reasoning):
    checker = GrammarChecker(tokenizer, 2048, [2])
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    parser = reasoning_parser(name, kwargs, "")
    grammar = after_reasoning(
        grammar_of(StructuredOutputsParams(json=schema)), parser.grammar_prefix(tokenizer)
    )
    assert checker.check(grammar) is None
    assert _accepts(checker, tokenizer, grammar, reasoning + '{"n":4}')
    assert not _accepts(checker, tokenizer, grammar, reasoning + '{"m":4}')
    assert not _accepts(checker, tokenizer, grammar, reasoning + "no JSON")
    assert not _accepts(checker, tokenizer, grammar, '{"n":4}')  # the reasoning must end first


# ---------------------------------------------------------------- through the chat handler


def _state(tokenizer: Any, model_dir: Path, family: str, parser: str, output: str):
    template = (TEMPLATES / f"{family}.jinja").read_text()
    model = ModelConfig(str(model_dir), "Qwen3ForCausalLM", 2048, 4096, (2, 0))
    model = msgspec.structs.replace(model, chat_template=template, reasoning_parser=parser)
    config = EngineConfig(
        model, cache=CacheConfig(block_size=16), scheduler=SchedulerConfig(max_model_len=4096)
    )
    token_ids = tokenizer(output, add_special_tokens=False).input_ids

    def script(request: EngineCoreRequest) -> list[Any]:
        outputs = [EngineCoreOutput(request.request_id, [t]) for t in token_ids]
        # EOS (<|im_end|>) ends it: a stop token's text is never in the output.
        outputs.append(EngineCoreOutput(request.request_id, [2], finish_reason="stop"))
        return outputs

    client = ScriptedEngineClient(config, script)
    return ServingState(client, tokenizer, "tiny", None, 1 << 20)  # type: ignore[arg-type]


async def _never_disconnects() -> dict[str, Any]:
    await asyncio.Event().wait()
    return {}


def _chat(state: ServingState, body: dict[str, Any]) -> Any:
    async def run() -> Any:
        request = decode_body(json.dumps(body).encode(), ChatCompletionRequest)
        response = await create_chat_completion(state, request, _never_disconnects)
        if body.get("stream"):
            return [chunk async for chunk in response.body_iterator]
        return json.loads(response.body)

    result = asyncio.run(run())
    if not body.get("stream"):
        return result
    events = b"".join(result).decode().split("\n\n")
    return [json.loads(e.removeprefix("data: ")) for e in events if e and "[DONE]" not in e]


FAMILIES = [
    ("qwen3", "qwen3", "<think>\nThe user greets.\n</think>\n\nHello!", "\nThe user greets.\n",
     "\n\nHello!"),
    ("deepseek_r1", "deepseek_r1", "The user greets.\n</think>\n\nHello!", "The user greets.\n",
     "\n\nHello!"),
    ("gpt_oss", "openai_gptoss", "<|channel|>analysis<|message|>The user greets.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>Hello!", "The user greets.", "Hello!"),
    ("deepseek_v31", "deepseek_v3", "The user greets.</think>Hello!", "The user greets.",
     "Hello!"),
    ("mistral3", "mistral", "[THINK]The user greets.[/THINK]Hello!", "The user greets.",
     "Hello!"),
    ("granite32", "granite", "Here is my thought process:\nThe user greets.\n"
     "Here is my response:\nHello!", "\nThe user greets.\n", "\nHello!"),
]  # fmt: skip
# The template variables that turn each family's thinking on (the others think by default).
THINKING = {"deepseek_v31": {"thinking": True}, "granite32": {"thinking": True}}


@pytest.mark.parametrize(("family", "parser", "output", "reasoning", "content"), FAMILIES)
def test_the_real_templates_answer_split_whole_and_streamed(
    tokenizer, tiny_model_dir, family, parser, output, reasoning, content
):
    state = _state(tokenizer, tiny_model_dir, family, parser, output)
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64}
    if family in THINKING:
        body["chat_template_kwargs"] = THINKING[family]
    whole = _chat(state, body)
    message = whole["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == (reasoning, content)
    details = whole["usage"]["completion_tokens_details"]
    num_reasoning = len(tokenizer(reasoning, add_special_tokens=False).input_ids)
    assert abs(details["reasoning_tokens"] - num_reasoning) <= 2
    assert details["reasoning_tokens"] < whole["usage"]["completion_tokens"]
    events = _chat(state, {**body, "stream": True, "stream_options": {"include_usage": True}})
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == reasoning
    assert "".join(d.get("content") or "" for d in deltas) == content
    assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:])
    for event in events[:-1]:  # each chunk carries something: no empty deltas
        (choice,) = event["choices"]
        assert set(choice["delta"]) - {"role"} or choice["finish_reason"]
    assert events[-1]["usage"] == whole["usage"]
    # include_reasoning false: the reasoning is left out, the content stays.
    hidden = _chat(state, {**body, "include_reasoning": False})["choices"][0]["message"]
    assert "reasoning" not in hidden and hidden["content"] == content
    hidden_deltas = _chat(state, {**body, "include_reasoning": False, "stream": True})
    assert not any(c["delta"].get("reasoning") for e in hidden_deltas for c in e["choices"])


def test_thinking_off_closes_the_reasoning_in_the_prompt(tokenizer, tiny_model_dir):
    state = _state(tokenizer, tiny_model_dir, "qwen3", "qwen3", "Hello!")
    body = {"messages": [{"role": "user", "content": "Hi"}], "return_prompt_text": True,
            "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    whole = _chat(state, body)
    assert whole["prompt_text"].endswith("<think>\n\n</think>\n\n")
    message = whole["choices"][0]["message"]
    assert "reasoning" not in message and message["content"] == "Hello!"
    # reasoning_effort "none" turns thinking off the same way (vLLM's enable_thinking).
    body = {"messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": "none"}
    assert _chat(state, body)["choices"][0]["message"]["content"] == "Hello!"


@pytest.mark.parametrize(
    ("family", "parser"), [("deepseek_v31", "deepseek_v3"), ("granite32", "granite")]
)
def test_hybrid_families_answer_without_reasoning_unless_asked(
    tokenizer, tiny_model_dir, family, parser
):
    output = dict((f, o) for f, _, o, _, _ in FAMILIES)[family]
    state = _state(tokenizer, tiny_model_dir, family, parser, output)
    body = {"messages": [{"role": "user", "content": "Hi"}], "return_prompt_text": True}
    whole = _chat(state, body)
    message = whole["choices"][0]["message"]
    assert "reasoning" not in message and message["content"] == output
    if family == "deepseek_v31":
        # (vLLM's copy of the template leaves its indentation in the prompt)
        assert whole["prompt_text"].rstrip().endswith("</think>")
        thinking = _chat(state, {**body, "chat_template_kwargs": {"thinking": True}})
        assert thinking["prompt_text"].rstrip().endswith("<think>")


def test_reasoning_effort_reaches_the_template(tokenizer, tiny_model_dir):
    state = _state(tokenizer, tiny_model_dir, "gpt_oss", "openai_gptoss", FAMILIES[2][2])
    for effort in ("low", "high"):
        body = {"messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": effort,
                "return_prompt_text": True}  # fmt: skip
        assert f"Reasoning: {effort}\n" in _chat(state, body)["prompt_text"]


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning": "I should call the tool.",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
]  # fmt: skip
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                             "description": "A city."}}}}}]  # fmt: skip


@pytest.mark.parametrize(
    ("family", "parser", "rendered"),
    [
        ("qwen3", "qwen3", "<think>\nI should call the tool.\n</think>"),
        ("gpt_oss", "openai_gptoss", "<|channel|>analysis<|message|>I should call the tool."),
        ("deepseek_r1", "deepseek_r1", None),  # its template drops earlier reasoning
    ],
)
def test_an_earlier_turns_reasoning_renders_as_the_template_reads_it(
    tokenizer, tiny_model_dir, family, parser, rendered
):
    state = _state(tokenizer, tiny_model_dir, family, parser, FAMILIES[0][2])
    for key in ("reasoning", "reasoning_content"):
        history = [dict(m) for m in HISTORY]
        history[1][key] = history[1].pop("reasoning")
        if family == "deepseek_r1":
            history = history[:1]
        body = {"messages": history, "tools": TOOLS, "tool_choice": "none",
                "return_prompt_text": True}  # fmt: skip
        prompt = _chat(state, body)["prompt_text"]
        if rendered is not None:
            assert rendered in prompt, prompt


def test_a_forced_call_is_read_after_the_reasoning(tokenizer, tiny_model_dir):
    # The grammar lets the reasoning through and forces the call after </think>; the reasoning
    # parser takes the reasoning out and the forced format is read from what follows.
    call = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    output = "<think>\nA weather question.\n</think>\n\n" + call
    state = _state(tokenizer, tiny_model_dir, "qwen3", "qwen3", output)
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS,
            "tool_choice": "required", "max_tokens": 64}  # fmt: skip
    whole = _chat(state, body)["choices"][0]
    assert whole["finish_reason"] == "tool_calls"
    assert whole["message"]["reasoning"] == "\nA weather question.\n"
    (tool_call,) = whole["message"]["tool_calls"]
    assert tool_call["function"]["name"] == "get_weather"
    assert json.loads(tool_call["function"]["arguments"]) == {"city": "Paris"}
    events = _chat(state, {**body, "stream": True})
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == "\nA weather question.\n"
    fragments = [
        c["function"].get("arguments", "") for d in deltas for c in d.get("tool_calls") or []
    ]
    assert "".join(fragments) == tool_call["function"]["arguments"] and len(fragments) > 2
    assert not any(d.get("content") for d in deltas)
