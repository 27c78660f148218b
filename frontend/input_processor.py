"""Prompts in, engine requests out: tokenize, check, fan ``n`` out. Shared by ``LLM`` and HTTP.

Runs in the frontend process. Everything a caller can get wrong is found here, before the first
engine request is sent, so a bad prompt never leaves half a batch in the engine; the engine re-checks
what it must (it never trusts the wire). A problem is a ``PromptError`` (a ``ValueError`` naming
the field), which the HTTP server turns into a 400 and ``LLM.generate`` raises as it is.

Each choice (one of the n samples of one prompt) becomes one engine request with its own
``ChoiceState``; choice index = prompt index * n + sample, and request id = ``{id}-{index}``. A
seeded request's samples get seeds seed, seed + 1, ..., so they differ, and the same seed gives
the same choices through either API.

Checks come in two weights. ``check_sizes`` and ``check_conversation_size`` cost no more than a
``len``: how many choices, and whether a text is too long to fit the context whatever the
tokenizer makes of it (more characters than ``max_model_len`` tokens of the vocabulary's longest
token can hold). They run first, so a request that will be refused is refused in microseconds.
Tokenizing and the chat template cost time in proportion to the input; a server runs them off its
event loop.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from conveyor.frontend.output_processor import ChoiceState
from conveyor.frontend.structured_outputs import GrammarChecker
from conveyor.protocol import CacheConfig, EngineConfig, EngineCoreRequest, SamplingParams
from conveyor.protocol.lora import LoRARequest
from conveyor.protocol.sampling_params import find_vocab_problem

# Arguments of ``apply_chat_template`` itself: a request's template variables may not replace them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "chat_template", "tokenize", "add_generation_prompt", "return_dict",
     "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs", "tools", "documents",
     "continue_final_message", "sanitize_control_tokens", "return_assistant_tokens_mask"}
)  # fmt: skip


@dataclass(frozen=True)
class ChatOptions:
    """How a conversation goes through the chat template: vLLM's chat request fields.

    ``add_generation_prompt``: the template opens the assistant's answer;
    ``continue_final_message``: the last message is left open for the model to go on with (not
    with the former); ``add_special_tokens``: the tokenizer adds its own (a BOS) on top of what
    the template wrote; ``template_kwargs``: variables of the template (``enable_thinking``,
    for one); ``tools``: function definitions and ``documents`` (for retrieval), both written
    in by templates that know them.
    """

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, str]] | None = None


class PromptError(ValueError):
    """A request that cannot run as given; ``param`` names the field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class Choice:
    """One engine request and the state that follows its outputs."""

    request: EngineCoreRequest
    state: ChoiceState


class InputProcessor:
    """``strict_context``: a prompt + max_tokens over the context is an error (the HTTP rule, as
    vLLM's server has it) rather than a request that runs until the context is full (``LLM``).
    ``max_choices``: the most engine requests (prompts x n) one call may fan out into."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Any,
        *,
        strict_context: bool = True,
        max_choices: int | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.strict_context = strict_context
        self.max_choices = max_choices
        self.max_model_len = context_limit(config)
        self._eos_token_ids = list(config.model.eos_token_ids)
        # What a request leaves out, the model's generation_config.json decides (if it says).
        self.sampling_defaults: dict[str, Any] = dict(config.model.sampling_defaults)
        self.chat_template = config.model.chat_template
        self.tool_call_parser = config.model.tool_call_parser
        self.reasoning_parser = config.model.reasoning_parser
        self.grammars = GrammarChecker(
            tokenizer,
            config.model.vocab_size,
            self._eos_token_ids,
            config.model.strict_object_schemas,
        )
        # No text of more characters than this can fit the context. A token's string in the
        # vocabulary is at least as long as the text it decodes to (one character per byte for
        # byte-level BPE, "▁" for a space in SentencePiece); the factor covers normalizers
        # that compose several characters into one.
        self.max_prompt_chars = self.max_model_len * max_token_chars(tokenizer) * 4

    def check_sizes(
        self, prompts: Sequence[str | Sequence[int]], n: int, truncating: bool = False
    ) -> None:
        """The cheap checks, before any tokenizing: the number of choices, and each prompt's
        length against the most the context could hold (unless the prompts are to be
        truncated: then only the body's size bounds them)."""
        if self.max_choices is not None and len(prompts) * n > self.max_choices:
            raise PromptError(
                f"{len(prompts)} prompts x n={n} exceeds {self.max_choices} choices per request",
                "n",
            )
        if truncating:
            return
        for i, prompt in enumerate(prompts):
            where = "" if len(prompts) == 1 else f"prompt {i}: "
            if isinstance(prompt, str):
                if len(prompt) > self.max_prompt_chars:
                    raise PromptError(
                        f"{where}the prompt has {len(prompt)} characters, more than "
                        f"{self.max_model_len} tokens (this model's context) can hold",
                        "prompt",
                    )
            elif len(prompt) >= self.max_model_len:
                raise PromptError(where + _too_long(len(prompt), self.max_model_len), "prompt")

    def check_conversation_size(self, num_messages: int, num_chars: int) -> None:
        """The cheap checks of a chat: every message costs at least one token of the context."""
        if num_messages >= self.max_model_len:
            raise PromptError(
                f"{num_messages} messages cannot fit this model's context of "
                f"{self.max_model_len} tokens",
                "messages",
            )
        if num_chars > self.max_prompt_chars:
            raise PromptError(
                f"the messages hold {num_chars} characters, more than {self.max_model_len} "
                "tokens (this model's context) can hold",
                "messages",
            )

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``add_special_tokens``: what the tokenizer adds around a text (a BOS, for one)."""
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the model's defaults (``--generation-config``)."""
        return SamplingParams(**self.sampling_defaults)

    def render_chat(
        self, conversation: list[dict[str, Any]], options: ChatOptions | None = None
    ) -> list[int]:
        """A conversation as prompt token ids: ``chat_text``, tokenized."""
        options = options or ChatOptions()
        text = self.chat_text(conversation, options)
        return self.tokenize(text, options.add_special_tokens)

    def chat_text(self, conversation: list[dict[str, Any]], options: ChatOptions) -> str:
        """A conversation through the chat template (``--chat-template``, else the tokenizer's
        own), as text; ``options`` say how (see ``ChatOptions``)."""
        if not conversation:
            raise PromptError("messages must not be empty", "messages")
        if options.continue_final_message and options.add_generation_prompt:
            # vLLM's rule: the last message cannot both go on and be followed by a new one.
            raise PromptError(
                "continue_final_message needs add_generation_prompt set to false",
                "continue_final_message",
            )
        tokenizer = self.tokenizer
        template = self.chat_template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise PromptError("this model has no chat template; use /v1/completions")
        template_kwargs = dict(options.template_kwargs or {})
        reserved = sorted(set(template_kwargs) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise PromptError(
                f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs"
            )
        try:
            return tokenizer.apply_chat_template(
                conversation,
                chat_template=template,
                add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message,
                tokenize=False,
                tools=options.tools,
                documents=options.documents,
                **template_kwargs,
            )
        except Exception as exc:  # a template may raise anything on input it does not expect
            raise PromptError(
                f"the chat template cannot render these messages: {exc}", "messages"
            ) from None

    def resolve_structured_outputs(
        self, params: SamplingParams, param: str = "structured_outputs", after: str | None = None
    ) -> SamplingParams:
        """``params`` with its structured-output constraint as a checked grammar (see
        ``frontend/structured_outputs.py``), applied ``after`` a reasoning parser's grammar
        prefix if given; a ``PromptError`` naming ``param`` if unusable."""
        try:
            return self.grammars.resolve(params, after)
        except RecursionError:
            # Python's parsers (a schema's JSON text, llguidance's GBNF converter) give up on
            # deep nesting this way: the client's input, so a 400, never a 500.
            raise PromptError(f"{param} is nested too deeply to parse", param) from None
        except ValueError as exc:
            # StructuredOutputError, or llguidance's own for a grammar it cannot convert. The
            # message names the field: Anthropic's error shape has no param to carry it.
            message = str(exc) if str(exc).startswith(param) else f"{param}: {exc}"
            raise PromptError(message, param) from None

    def truncate(
        self, token_ids: list[int], truncate_prompt_tokens: int | None, side: str | None = None
    ) -> list[int]:
        """The prompt cut to ``truncate_prompt_tokens`` tokens (-1: this model's context), as
        vLLM cuts it: its last ones, or with ``side`` "right" its first ones."""
        if truncate_prompt_tokens is None:
            return token_ids
        if truncate_prompt_tokens == -1:
            truncate_prompt_tokens = self.max_model_len
        if not 1 <= truncate_prompt_tokens <= self.max_model_len:
            raise PromptError(
                f"truncate_prompt_tokens must be -1 or between 1 and this model's context of "
                f"{self.max_model_len} tokens, got {truncate_prompt_tokens}",
                "truncate_prompt_tokens",
            )
        if side == "right":
            return token_ids[:truncate_prompt_tokens]
        return token_ids[-truncate_prompt_tokens:]

    def to_token_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenize(prompt)
        try:
            return [int(t) for t in prompt]
        except (TypeError, ValueError) as exc:
            raise PromptError(
                f"a prompt must be a string or a list of token ids: {exc}", "prompt"
            ) from None

    def check_prompt(
        self, token_ids: list[int], max_tokens: int | None, index: int | None = None
    ) -> None:
        """``PromptError`` unless the prompt can run: valid ids, room for output, and prompt +
        max_tokens within the engine's whole KV cache (else the engine could only fail it)."""
        where = "" if index is None else f"prompt {index}: "
        problem = find_prompt_problem(token_ids, self.config.model.vocab_size, self.max_model_len)
        if problem is not None:
            raise PromptError(where + problem, "prompt")
        room = self.max_model_len - len(token_ids)
        if max_tokens is not None and max_tokens > room:
            if self.strict_context:
                raise PromptError(
                    f"{where}this model's maximum context length is {self.max_model_len} "
                    f"tokens, but {len(token_ids) + max_tokens} were requested "
                    f"({len(token_ids)} in the prompt, {max_tokens} for the completion); "
                    "shorten the prompt or lower max_tokens",
                    "max_tokens",
                )
            # The engine stops at the context: the pool need hold no more.
            max_tokens = room
        problem = find_kv_cache_problem(len(token_ids), max_tokens, self.config.cache)
        if problem is not None:
            raise PromptError(where + problem, "max_tokens")

    def make_choices(
        self,
        prompts: Sequence[list[int]],
        params: SamplingParams | Sequence[SamplingParams],
        request_id: str,
        arrival_time: float,
        *,
        priority: int = 0,
        stream: bool = False,
        structured_param: str = "structured_outputs",
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[Choice]:
        """One engine request per choice, for checked prompts; ``params`` is one for all
        prompts or one per prompt. Every choice has the same n, so indices are dense.
        ``structured_param`` names the field a bad structured-output constraint came from."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        if len(per_prompt) != len(prompts):
            raise PromptError(f"got {len(per_prompt)} sampling params for {len(prompts)} prompts")
        if self.max_choices is not None and sum(p.n for p in per_prompt) > self.max_choices:
            raise PromptError(
                f"{len(prompts)} prompts x n={per_prompt[0].n} exceeds {self.max_choices} "
                "choices per request",
                "n",
            )
        vocab_size = self.config.model.vocab_size
        for prompt_params in per_prompt:
            problem = find_vocab_problem(prompt_params, vocab_size, self.config.model.max_logprobs)
            if problem is not None:
                raise PromptError(problem, problem.split(" ", 1)[0])
        per_prompt = [self.resolve_structured_outputs(p, structured_param) for p in per_prompt]
        wall_time = time.time()  # the engine's arrival time is wall-clock
        choices, index = [], 0
        for token_ids, prompt_params in zip(prompts, per_prompt):
            for sample_params in fan_out(prompt_params):
                choice_id = f"{request_id}-{index}"
                request = EngineCoreRequest(
                    choice_id,
                    token_ids,
                    sample_params,
                    wall_time,
                    priority,
                    self._eos_token_ids,
                    cache_salt,
                    lora_request,
                )
                state = ChoiceState(
                    index, choice_id, self.tokenizer, token_ids, sample_params, arrival_time, stream
                )
                choices.append(Choice(request, state))
                index += 1
        return choices


def fan_out(params: SamplingParams) -> list[SamplingParams]:
    """n samples -> n single-sample requests; seeded ones get seed + i so they differ."""
    if params.n == 1:
        return [params]
    try:
        return [
            msgspec.structs.replace(
                params, n=1, seed=None if params.seed is None else params.seed + i
            )
            for i in range(params.n)
        ]
    except ValueError as exc:  # seed + i past the 64-bit range
        raise PromptError(f"with n={params.n}: {exc}", "seed") from None


def context_limit(config: EngineConfig) -> int:
    """The most tokens (prompt + output) one request may hold: the engine's scheduler may be
    configured below the model's own limit, and the engine enforces the scheduler's."""
    return min(config.model.max_model_len, config.scheduler.max_model_len)


def find_prompt_problem(
    prompt_token_ids: list[int], vocab_size: int, max_model_len: int
) -> str | None:
    """A human-readable reason the prompt cannot run, or None if it can."""
    if not prompt_token_ids:
        return "the prompt is empty"
    if not all(isinstance(t, int) for t in prompt_token_ids):
        return "prompt token ids must be integers"
    low, high = min(prompt_token_ids), max(prompt_token_ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        return f"token id {bad} is outside the vocabulary [0, {vocab_size})"
    if len(prompt_token_ids) >= max_model_len:
        return _too_long(len(prompt_token_ids), max_model_len)
    return None


def _too_long(num_tokens: int, max_model_len: int) -> str:
    return (
        f"the prompt has {num_tokens} tokens, but max_model_len is {max_model_len} "
        "(the prompt must leave room for at least one generated token)"
    )


def max_token_chars(tokenizer: Any) -> int:
    """The longest string of the tokenizer's vocabulary: no token decodes to more characters."""
    try:
        return max(map(len, tokenizer.get_vocab()), default=1) or 1
    except (AttributeError, NotImplementedError, TypeError):
        return 1 << 10  # an unknown tokenizer: a bound that still stops megabytes


def find_kv_cache_problem(
    num_prompt_tokens: int, max_tokens: int | None, cache: CacheConfig
) -> str | None:
    """A reason the request can never fit the engine's whole KV pool, or None.

    Counts prompt + max_tokens, as a policy that reserves every output's block at admission
    does. ``max_tokens=None`` (until the context is full) is checked for its prompt and first
    token only: it may end (EOS) long before the context is full. An engine that did not say how
    many blocks it has (``num_blocks`` None) is left to decide on its own, as is one whose model
    attends through a sliding window (a request there holds only its window's blocks; the engine
    lowered max_model_len if even that does not fit).
    """
    if cache.num_blocks is None or cache.sliding_window is not None:
        return None
    num_tokens = num_prompt_tokens + (1 if max_tokens is None else max_tokens)
    num_needed = -(-num_tokens // cache.block_size)
    num_usable = cache.num_blocks - 1  # block 0 is the engine's reserved null block
    if num_needed <= num_usable:
        return None
    output = "its first output token" if max_tokens is None else f"max_tokens={max_tokens}"
    return (
        f"the prompt ({num_prompt_tokens} tokens) and {output} need {num_needed} KV cache blocks "
        f"of {cache.block_size} tokens, but the server's whole KV cache holds {num_usable} "
        f"({num_usable * cache.block_size} tokens); shorten the prompt or lower max_tokens"
    )
