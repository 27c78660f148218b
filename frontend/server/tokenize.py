"""POST /tokenize, POST /detokenize, GET /version: vLLM's utility endpoints, same shapes.

Runs in an HTTP frontend process. ``/tokenize`` takes a ``prompt`` (a completion's text) or
``messages`` (a chat, through the same chat template and template variables as
``/v1/chat/completions``), so a client can count what a request will cost before sending it;
``/detokenize`` turns token ids back into text. Both go through the serving pipeline's
``InputProcessor`` and, when their input is large, run off the event loop.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

import msgspec

from conveyor.frontend.input_processor import ChatOptions
from conveyor.frontend.server.chat import conversation_of
from conveyor.frontend.server.chat_tools import tool_dict
from conveyor.frontend.server.errors import bad_request
from conveyor.frontend.server.request_models import ChatMessage, Int64, StrictStruct, ToolDef
from conveyor.frontend.server.serving import ServingState, as_bad_request, check_model

PACKAGE = "conveyor-llm"


class TokenizeRequest(StrictStruct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # None: True for a prompt (as a completion adds them), False for messages (the template
    # writes its own special tokens).
    add_special_tokens: bool | None = None
    # The chat fields (with messages only); None: the generation prompt is added.
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Function definitions the chat template writes into the prompt, as chat passes them.
    tools: list[ToolDef] | None = None
    return_token_strs: bool = False


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(StrictStruct, kw_only=True):
    tokens: list[Int64]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


def package_version() -> str:
    try:
        return version(PACKAGE)
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


async def tokenize(state: ServingState, body: TokenizeRequest) -> TokenizeResponse:
    check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give either prompt or messages", "prompt")
    inputs = state.inputs
    if body.messages is not None:
        conversation, size = conversation_of(state, body.messages)
        options = ChatOptions(
            add_generation_prompt=body.add_generation_prompt is not False,
            continue_final_message=bool(body.continue_final_message),
            # As chat: the template writes the special tokens, unless asked for more.
            add_special_tokens=bool(body.add_special_tokens),
            template_kwargs=body.chat_template_kwargs,
            tools=[tool_dict(tool) for tool in body.tools] if body.tools else None,
        )
        with as_bad_request():
            token_ids = await state.run_cpu_unless_small(
                size, inputs.render_chat, conversation, options
            )
    else:
        assert body.prompt is not None
        chat_only = ("chat_template_kwargs", "add_generation_prompt", "continue_final_message")
        for name in (*chat_only, "tools"):
            if getattr(body, name) is not None:  # a chat's field: it would change nothing here
                raise bad_request(f"{name} needs messages", name)
        with as_bad_request():
            inputs.check_sizes([body.prompt], 1)
        add_special_tokens = body.add_special_tokens is not False
        token_ids = await state.run_cpu_unless_small(
            len(body.prompt), _encode, state.tokenizer, body.prompt, add_special_tokens
        )
    token_strs = None
    if body.return_token_strs:
        token_strs = state.tokenizer.convert_ids_to_tokens(token_ids)
    return TokenizeResponse(len(token_ids), inputs.max_model_len, token_ids, token_strs)


async def detokenize(state: ServingState, body: DetokenizeRequest) -> DetokenizeResponse:
    check_model(state, body.model)
    vocab_size = state.config.model.vocab_size
    if any(not 0 <= t < vocab_size for t in body.tokens):
        raise bad_request(f"tokens must be token ids in [0, {vocab_size})", "tokens")
    text = await state.run_cpu_unless_small(len(body.tokens), state.tokenizer.decode, body.tokens)
    return DetokenizeResponse(text)


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
