"""OpenAI request bodies as msgspec Structs, and their conversion to ``SamplingParams``.

Runs in an HTTP frontend process. Decoding a body with ``msgspec.json.decode(body, type=...)``
checks every field's type (no pydantic layer); the conversion then checks values, so each bad
input becomes an ``ApiError`` (400) naming the field. A field this server does not know is a 400
that names it, as OpenAI answers (``forbid_unknown_fields``): a field silently dropped would change
results without a word. Fields it knows but cannot honour (``suffix``, vLLM's ``bad_words``, ...)
are refused the same way, unless they hold the value that asks for nothing (``UNSUPPORTED``: what
a client that writes every field of vLLM's request sends). Bookkeeping fields that change
nothing about generation (``user``, ``metadata``, ``store``, ``service_tier``, ...: clients and
gateways send them routinely) are accepted without effect. docs/api.md lists every field of
vLLM's requests with its status here. The response bodies live in
``frontend.server.response_models``.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Union

import msgspec

from conveyor.frontend.server.errors import bad_request
from conveyor.protocol import SamplingParams, StructuredOutputsParams
from conveyor.protocol.sampling_params import MAX_STOP_TOKEN_IDS

# OpenAI's default max_tokens for /v1/completions.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# Integers must fit the wire (msgpack int64); a bigger JSON number is a 400, not a crash.
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]

# A prompt: one text, a batch of texts, one token-id list, or a batch of token-id lists.
# (msgspec allows one array type per union, so the batch forms share one element union.)
PromptField = Union[str, list[Union[str, Int64, list[Int64]]]]


class StrictStruct(msgspec.Struct, forbid_unknown_fields=True):
    """A request body part: an unknown field is a decode error, so a 400 naming it."""


class StreamOptions(StrictStruct):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries its choice's usage so far.
    continuous_usage_stats: bool = False
    # OpenAI's random padding of chunks against length side channels: accepted, no effect.
    include_obfuscation: bool | None = None


class StructuredOutputsField(StrictStruct, kw_only=True):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class JsonSchemaFormat(StrictStruct, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(StrictStruct, kw_only=True):
    """OpenAI's ``response_format``: text, json_object, or json_schema with its schema."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(StrictStruct, kw_only=True):
    """Fields both endpoints share; ``None`` means "the SamplingParams default".

    OpenAI's clients send an explicit ``null`` for a parameter set to None, meaning "the default":
    the fields they may send so are Optional here, and ``__post_init__`` (which msgspec runs on
    decode) puts the default back, so the handlers never see None in them.
    """

    model: str | None = None
    n: Int64 | None = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 = 0
    include_stop_str_in_output: bool = False
    priority: Int64 = 0
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[Int64] | None = None
    truncate_prompt_tokens: Int64 | None = None
    # vLLM's: "left" (None) keeps the prompt's last tokens, "right" its first.
    truncation_side: str | None = None
    structured_outputs: StructuredOutputsField | None = None
    response_format: ResponseFormat | None = None
    # vLLM's detokenizing options.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # vLLM's: the prompt's and each choice's token ids in the response.
    return_token_ids: bool | None = None
    # vLLM's: logprobs name their tokens "token_id:{id}" instead of their text.
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: the response's id (after "cmpl-" / "chatcmpl-") instead of a random one.
    request_id: str | None = None
    # vLLM's: a stream sends a choice's tokens this many at a time (first and last at once).
    stream_interval: Int64 | None = None
    # vLLM's: the prompt tokens' logprobs, with this many top alternatives per position.
    prompt_logprobs: Int64 | None = None
    # vLLM's: prefix-cache blocks are shared only with requests of the same salt.
    cache_salt: str | None = None

    # Accepted, no effect: bookkeeping that changes nothing about generation. OpenAI's end-user
    # ids, tags, storage, tier and prompt-cache routing; vLLM's session id (it routes, nothing
    # more) and its options of what only its /render endpoints return.
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    session_id: str | None = None
    return_token_offsets: bool | None = None
    return_mm_kwargs: bool | None = None
    routed_experts_prompt_start: Int64 | None = None
    # vLLM's beam-search weight: nothing without beam search (use_beam_search is refused).
    length_penalty: float | None = None

    # vLLM's fields of features conveyor does not have: only their no-op value (UNSUPPORTED).
    use_beam_search: Any = None
    watermarking: Any = None
    bad_words: Any = None
    logprob_token_ids: Any = None
    thinking_token_budget: Any = None
    repetition_detection: Any = None
    vllm_xargs: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None

    def __post_init__(self) -> None:
        if self.n is None:
            self.n = 1
        if self.stream is None:
            self.stream = False


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: PromptField
    # None: the model's max_new_tokens (generation_config.json), else OpenAI's 16.
    max_tokens: Int64 | None = None
    logprobs: Int64 | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: Int64 | None = None
    # vLLM's: the tokenizer adds its special tokens (a BOS) to a text prompt.
    add_special_tokens: bool = True
    prompt_embeds: Any = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.echo is None:
            self.echo = False


class ContentPart(StrictStruct):
    type: str
    text: str | None = None


class FunctionCallIn(StrictStruct):
    name: str
    arguments: str


class ToolCallIn(StrictStruct):
    """An assistant's earlier tool call, in the history."""

    id: str
    function: FunctionCallIn
    type: str = "function"


class ChatMessage(StrictStruct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    # An earlier answer's reasoning, as vLLM returns it (``reasoning``) or as older servers
    # and clients name it (``reasoning_content``): rendered where the template reads it.
    reasoning: str | None = None
    reasoning_content: str | None = None


class FunctionDef(StrictStruct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(StrictStruct):
    function: FunctionDef
    type: str = "function"


class NamedFunction(StrictStruct):
    name: str


class NamedToolChoice(StrictStruct):
    function: NamedFunction
    type: str = "function"


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool | None = False
    top_logprobs: Int64 | None = None
    tools: list[ToolDef] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Variables for the chat template (e.g. {"enable_thinking": false}), and vLLM's other
    # templating fields (``ChatOptions``).
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    # A template variable (as vLLM passes it), which also sets enable_thinking unless
    # chat_template_kwargs does: "none" turns thinking off.
    reasoning_effort: str | None = None
    # vLLM's: the answer starts with the last message's content when that message has the
    # answer's role (continue_final_message's partner).
    echo: bool | None = False
    # vLLM's: the prompt's text, as the chat template wrote it, in the response.
    return_prompt_text: bool | None = None
    # vLLM's: false leaves out what the reasoning parser split from the content.
    include_reasoning: bool | None = None
    # Accepted, no effect: OpenAI's predicted output only speeds its own service up.
    prediction: dict[str, Any] | None = None
    # Only their no-op value (UNSUPPORTED).
    chat_template: Any = None
    mm_processor_kwargs: Any = None
    media_io_kwargs: Any = None
    modalities: Any = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.logprobs is None:
            self.logprobs = False
        if self.echo is None:
            self.echo = False


# The most characters of a client's request_id (it is the response's id and goes into logs).
MAX_REQUEST_ID_CHARS = 256
# vLLM's reasoning_effort values.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")

# Fields of a feature conveyor does not have: field -> (the values that ask for nothing, why
# anything else is refused). A client that writes every field of vLLM's request (its defaults
# included) sends these values.
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((None, False), "beam search is not implemented"),
    "watermarking": ((None, False), "not implemented"),
    "bad_words": ((None, []), "not implemented (logit_bias bans single tokens)"),
    "logprob_token_ids": ((None,), "not implemented (use logprobs)"),
    "thinking_token_budget": ((None, -1), "not implemented"),
    "repetition_detection": ((None,), "not implemented"),
    "vllm_xargs": ((None, {}), "for extensions this server does not have"),
    "kv_transfer_params": ((None,), "needs a KV connector (disaggregated serving)"),
    "ec_transfer_params": ((None,), "needs an encoder-cache connector"),
    "prompt_embeds": ((None,), "not supported (send text or token ids)"),
    "chat_template": (
        (None,),
        "a request's own template is not accepted (nor by vLLM, unless started with "
        "--trust-request-chat-template); start the server with --chat-template",
    ),
    "mm_processor_kwargs": ((None, {}), "multimodal input is not supported"),
    "media_io_kwargs": ((None, {}), "multimodal input is not supported"),
    "modalities": ((None, ["text"]), "only text output is supported"),
}

_OPTIONAL_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def decode_body(body: bytes, body_type: type[Any]) -> Any:
    """JSON bytes -> the request Struct; any malformed or mistyped input is a 400."""
    try:
        return msgspec.json.decode(body, type=body_type)
    except msgspec.ValidationError as exc:
        # msgspec ends its message with "- at `$.field`": a path, never the offending value.
        return _raise_invalid(str(exc))
    except msgspec.DecodeError as exc:
        # msgspec 0.23 reports invalid UTF-8 inside a string here (earlier ones, below).
        if "UTF-8" in str(exc):
            raise bad_request(f"the request body is not valid UTF-8: {exc}") from None
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        # Even an unknown field is parsed to skip it: deep nesting must be a 400, not a 500.
        raise bad_request("the request body is nested too deeply") from None
    except UnicodeDecodeError as exc:
        # msgspec decodes a string's bytes lazily: invalid UTF-8 inside one surfaces as this.
        raise bad_request(f"the request body is not valid UTF-8: {exc.reason}") from None


class _Counted(msgspec.Struct):
    """Just the fields whose size decides the cost of decoding a body, left undecoded."""

    prompt: msgspec.Raw = msgspec.Raw()
    messages: msgspec.Raw = msgspec.Raw()
    # The Responses API's list of input items.
    input: msgspec.Raw = msgspec.Raw()


def decode_large_body(
    body: bytes, body_type: type[Any], max_prompts: int, max_messages: int, max_tokens: int
) -> Any:
    """``decode_body`` for a large body, refusing first, from counts on the raw bytes, what
    holds far too many values to run.

    Decoding builds one Python object per value while holding the GIL (about 100 ms for 8 MiB
    of 240k chat messages): that long, no other thread of the frontend runs, its event loop
    included. Skipping a value without building it costs a tenth of that, and the counts below
    are lower bounds, so a request is refused only when it certainly exceeds a limit.
    """
    try:
        counted = msgspec.json.decode(body, type=_Counted)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
        return decode_body(body, body_type)  # reports what is wrong with it
    for name, raw in (("messages", counted.messages), ("input", counted.input)):
        if raw:
            _count_messages(bytes(raw), name, max_messages)
    prompt = bytes(counted.prompt)
    if prompt.startswith(b"["):
        if b'"' in prompt:
            # `",` ends every string of a list but the last; inside a string it is `\",`.
            num_strings = prompt.count(b'",') - prompt.count(b'\\",') + 1
            if num_strings > max_prompts:
                raise bad_request(f"over {max_prompts} prompts in one request", "prompt")
        elif prompt.count(b",") + 1 > max_prompts * max_tokens:
            raise bad_request(
                f"over {max_prompts * max_tokens} prompt token ids: more than {max_prompts} "
                f"prompts of this model's context of {max_tokens} tokens",
                "prompt",
            )
    return decode_body(body, body_type)


def _count_messages(raw: bytes, param: str, max_messages: int) -> None:
    """Refuse a list of messages (or Responses' input items) that certainly holds more than
    the context can: more "role" keys than ``max_messages``, or more "type" keys (content
    parts, blocks, items) than twice that. Every JSON encoder we know writes a key as `"key":`
    or `"key" :` (others are counted as none); the text cannot occur in a string."""
    num_roles = raw.count(b'"role":') + raw.count(b'"role" :')
    num_typed = raw.count(b'"type":') + raw.count(b'"type" :')
    if num_roles > max_messages or num_typed > 2 * max_messages:
        raise bad_request(
            f"{param}: over {max_messages} messages or {2 * max_messages} content parts, more "
            "than this model's context can hold",
            param,
        )


def _raise_invalid(message: str) -> Any:
    path = message.rsplit("`$", 1)[1].rstrip("`").lstrip(".") if "`$" in message else ""
    unknown = re.match(r"Object contains unknown field `([^`]*)`", message)
    if unknown is not None:
        field = unknown.group(1)
        param = f"{path}.{field}" if path else field
        raise bad_request(
            f"unknown field {param!r}: this server does not implement it (see docs/api.md)", param
        )
    raise bad_request(f"invalid request: {message}", path or None)


def stop_strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def to_sampling_params(
    body: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    vocab_size: int,
    defaults: dict[str, Any] | None = None,
) -> SamplingParams:
    """The engine's sampling parameters for one sample of ``body`` (n is fanned out later);
    400 for any field, or combination of fields, that cannot be honoured. ``defaults`` (the
    model's generation config) fill the sampling fields the body leaves out."""
    if body.stream_options is not None and not body.stream:
        # OpenAI's rule: the options describe a stream, so without one they are a mistake.
        raise bad_request("stream_options can only be given with stream: true", "stream_options")
    check_unsupported(body)
    check_request_id(body.request_id)
    if body.stream_interval is not None and body.stream_interval < 1:
        raise bad_request("stream_interval must be at least 1", "stream_interval")
    if body.truncation_side not in (None, "left", "right"):
        side = body.truncation_side
        raise bad_request(f"truncation_side must be left or right, got {side!r}", "truncation_side")
    stop_token_ids = list(body.stop_token_ids or ())
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        # Counted as sent; SamplingParams counts the distinct ones it keeps.
        raise bad_request(
            f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(stop_token_ids)}",
            "stop_token_ids",
        )
    if any(not 0 <= t < vocab_size for t in stop_token_ids):
        raise bad_request(f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids")
    kwargs: dict[str, Any] = {}
    for name in _OPTIONAL_SAMPLING_FIELDS:
        value = getattr(body, name)
        if value is None and defaults:
            value = defaults.get(name)
        if value is not None:
            kwargs[name] = value
    if body.logit_bias:
        kwargs["logit_bias"] = _logit_bias(body.logit_bias, vocab_size)
    structured = structured_outputs_of(body)
    if structured is not None:
        kwargs["structured_outputs"] = structured
    if body.allowed_token_ids is not None:
        if any(not 0 <= t < vocab_size for t in body.allowed_token_ids):
            raise bad_request(
                f"allowed_token_ids must be in [0, {vocab_size})", "allowed_token_ids"
            )
        kwargs["allowed_token_ids"] = list(body.allowed_token_ids)
    try:
        return SamplingParams(
            n=body.n,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=stop_strings(body.stop),
            stop_token_ids=stop_token_ids,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs_of(body, logprobs),
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            spaces_between_special_tokens=body.spaces_between_special_tokens,
            **kwargs,
        )
    except (ValueError, TypeError) as exc:
        # SamplingParams' messages start with the field's name.
        message = str(exc)
        param = message.split(" ", 1)[0]
        raise bad_request(message, param if hasattr(body, param) else None) from None


def prompt_logprobs_of(body: SamplingFields, logprobs: int | None) -> int | None:
    """vLLM's ``prompt_logprobs``; a completion's ``echo`` with ``logprobs`` asks for them too
    (the echoed prompt carries its tokens' logprobs, as OpenAI's legacy API did). A chat's
    ``echo`` repeats the last message's text only: its logprobs are the answer's."""
    wanted = body.prompt_logprobs
    if isinstance(body, CompletionRequest) and body.echo and logprobs is not None:
        wanted = max(wanted or 0, logprobs)
    return wanted


def check_unsupported(body: SamplingFields) -> None:
    """400 for a field of a feature this server lacks, unless it asks for nothing."""
    for name, (no_op, reason) in UNSUPPORTED.items():
        value = getattr(body, name, None)
        if not any(value == v and type(value) is type(v) for v in no_op):
            raise bad_request(f"{name}: {reason}", name)


def check_request_id(request_id: str | None) -> None:
    if request_id is not None and not 1 <= len(request_id) <= MAX_REQUEST_ID_CHARS:
        raise bad_request(
            f"request_id must hold 1 to {MAX_REQUEST_ID_CHARS} characters", "request_id"
        )


def response_id_of(prefix: str, body: SamplingFields, engine_id: str) -> str:
    """The response's id: the client's ``request_id`` (vLLM's), else the engine requests' own
    (which stay unique whatever a client sends), after OpenAI's prefix."""
    return f"{prefix}-{body.request_id or engine_id}"


def chat_template_variables(body: ChatCompletionRequest) -> dict[str, Any] | None:
    """``chat_template_kwargs`` with ``reasoning_effort`` added as vLLM adds it: a variable of
    its own, and ``enable_thinking`` (off for "none") unless the request set that itself."""
    effort = body.reasoning_effort
    if effort is None:
        return body.chat_template_kwargs
    if effort not in REASONING_EFFORTS:
        raise bad_request(
            f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
            "reasoning_effort",
        )
    variables = dict(body.chat_template_kwargs or {})
    variables["reasoning_effort"] = effort
    variables.setdefault("enable_thinking", effort != "none")
    return variables


def structured_outputs_of(body: SamplingFields) -> StructuredOutputsParams | None:
    """The request's structured-output constraint: ``structured_outputs`` (both endpoints) or
    chat's ``response_format``; not yet checked (the pipeline compiles and checks it)."""
    field = body.structured_outputs
    response_format = getattr(body, "response_format", None)
    from_format = None
    if response_format is not None and response_format.type != "text":
        from_format = _from_response_format(response_format)
    if field is not None and from_format is not None:
        raise bad_request(
            "give structured_outputs or response_format, not both", "structured_outputs"
        )
    if from_format is not None:
        return from_format
    if field is None:
        return None
    spec = StructuredOutputsParams(
        json=field.json,
        regex=field.regex,
        choice=field.choice,
        grammar=field.grammar,
        json_object=bool(field.json_object),
    )
    if len(spec.kinds()) != 1:
        raise bad_request(
            "structured_outputs must set exactly one of json, regex, choice, grammar, json_object",
            "structured_outputs",
        )
    return spec


def _from_response_format(response_format: ResponseFormat) -> StructuredOutputsParams:
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if response_format.type == "json_schema":
        spec = response_format.json_schema
        if spec is None or spec.schema is None:
            raise bad_request(
                "response_format json_schema needs json_schema.schema", "response_format"
            )
        return StructuredOutputsParams(json=spec.schema)
    raise bad_request(
        f"response_format type must be text, json_object or json_schema, got "
        f"{response_format.type!r}",
        "response_format",
    )


def structured_param(body: SamplingFields) -> str:
    """The field a structured-output error is reported against."""
    response_format = getattr(body, "response_format", None)
    if response_format is not None and response_format.type != "text":
        return "response_format"
    return "structured_outputs"


def _logit_bias(logit_bias: dict[str, float], vocab_size: int) -> dict[int, float]:
    """OpenAI's {"token id": bias} (JSON keys are strings) -> {token id: bias}."""
    converted = {}
    for key, bias in logit_bias.items():
        try:
            token_id = int(key)
        except ValueError:
            message = f"logit_bias keys must be token ids, got {key!r}"
            raise bad_request(message, "logit_bias") from None
        if not 0 <= token_id < vocab_size:
            raise bad_request(f"logit_bias token ids must be in [0, {vocab_size})", "logit_bias")
        converted[token_id] = bias
    return converted


def completion_max_tokens(body: CompletionRequest, defaults: dict[str, Any]) -> int | None:
    """The request's max_tokens, else the model's max_new_tokens, else OpenAI's 16."""
    if body.max_tokens is not None:
        return body.max_tokens
    return int(defaults.get("max_tokens", DEFAULT_COMPLETION_MAX_TOKENS))


def check_completion_request(body: CompletionRequest) -> None:
    """Refuse the completion features this server does not implement."""
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of is not supported (use n)", "best_of")
    # The server's cap (--max-logprobs) is checked with the other limits of the model.
    if body.logprobs is not None and body.logprobs < 0:
        raise bad_request("logprobs must be >= 0", "logprobs")


def chat_num_logprobs(body: ChatCompletionRequest) -> int | None:
    """Chat's ``logprobs: bool`` + ``top_logprobs: int`` -> the engine's top-k count (or None)."""
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        if body.top_logprobs < 0:
            raise bad_request("top_logprobs must be >= 0", "top_logprobs")
    if not body.logprobs:
        return None
    return body.top_logprobs or 0


def chat_max_tokens(body: ChatCompletionRequest, defaults: dict[str, Any]) -> int | None:
    """The newer name wins, as in OpenAI's API; without either, the model's max_new_tokens, else
    until the context is full."""
    if body.max_completion_tokens is not None:
        return body.max_completion_tokens
    if body.max_tokens is not None:
        return body.max_tokens
    default = defaults.get("max_tokens")
    return None if default is None else int(default)


def message_text(message: ChatMessage, index: int) -> str:
    """A message's content as one string; only text parts are supported."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise bad_request(
                f"messages[{index}]: only text content parts are supported", "messages"
            )
        texts.append(part.text)
    return "".join(texts)


def prompt_list(prompt: Any) -> list[str | list[int]]:
    """Normalize the four prompt forms to a list of texts or token-id lists (never mixed)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("the prompt is empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) for p in prompt):
        return [list(p) for p in prompt]
    raise bad_request(
        "prompt must be a string, a list of strings, a token-id list or a list of those", "prompt"
    )
