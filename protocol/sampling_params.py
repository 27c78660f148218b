"""Sampling parameters: built by the frontend, carried to the engine and the workers.

Shared by every process. Validation runs in ``__post_init__`` so a bad value is rejected where the
object is made (the offline API, the HTTP layer) and again if a malformed one arrives on the wire
(msgspec turns the ValueError into a ValidationError on decode).
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

# A cap that keeps one request from asking the frontend to fan out unbounded work.
MAX_N = 16
# Top-k alternatives per token unless the server sets its own cap (vLLM's --max-logprobs, whose
# default this is); the sampler sorts the full vocabulary row at most once per token.
MAX_LOGPROBS = 20
# Stop strings are searched in the text after every token, stop token ids looked up per token:
# caps that keep one request's per-token stop checks (and its wire size) small. A streamed choice
# also holds back the longest stop string's length of text (it may be one's start), so a long one
# would turn a stream into a whole response: real stop strings are a word or a line.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
# Per-token biases and allow-lists travel with the request and build a row of the sampler's mask
# per step: bounded as OpenAI bounds logit_bias (300 entries of -100..100).
MAX_LOGIT_BIAS = 300
MAX_LOGIT_BIAS_VALUE = 100.0
MAX_ALLOWED_TOKEN_IDS = 1 << 17
# A grammar's text travels with every choice of its request.
MAX_GRAMMAR_CHARS = 1 << 20
# llguidance's parser limits, set here rather than left to its defaults so that the frontend's
# check and the workers' matchers agree on what a grammar may cost (the check builds a matcher
# and its first mask under these; a later step that exceeds them fails its request). The
# per-step caps keep one structured row's mask to a few milliseconds (llguidance: ~14k lexer
# fuel and ~20k Earley items per millisecond).
GRAMMAR_LIMITS: dict[str, int | bool] = {
    "max_items_in_row": 2000,
    "initial_lexer_fuel": 1_000_000,
    "step_lexer_fuel": 200_000,
    "step_max_items": 50_000,
    "max_lexer_states": 250_000,
    "max_grammar_size": 500_000,
    # Errors name the limit, not the parser's state and the whole grammar (an error reason
    # travels to the client and into logs).
    "verbose_errors": False,
}


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, frozen=True, gc=False):
    """vLLM's structured outputs: exactly one of these constrains what may be generated.

    ``json``: a JSON schema (a dict, or its JSON text); ``regex``; ``choice``: the output is one
    of these strings; ``grammar``: a Lark or GBNF grammar; ``json_object``: any JSON object. The
    frontend turns it into ``SamplingParams.grammar`` (an llguidance grammar) and checks it.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def kinds(self) -> list[str]:
        """The constraints given (a valid one has exactly one)."""
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name)]
        return given + (["json_object"] if self.json_object else [])


class SamplingParams(msgspec.Struct, omit_defaults=True, frozen=True, gc=False):
    """How to pick each next token and when to stop.

    ``temperature == 0`` means greedy. ``top_k <= 0`` and ``top_p == 1`` and ``min_p == 0`` mean
    "off". ``max_tokens=None`` means "until the context is full".
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = []
    # A set: the engine checks every sampled token against it. A list given here is converted.
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    logprobs: int | None = None
    # Log-probabilities of the prompt's tokens (each given the ones before it), with this many
    # most likely alternatives per position: vLLM's prompt_logprobs (and completions' echo with
    # logprobs). Computed in the forward passes that prefill the prompt, so such a request
    # reads no prefix-cache hit.
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Keep the stop string in the returned text (the frontend applies it).
    include_stop_str_in_output: bool = False
    # How the frontend turns output tokens into text, as vLLM's detokenizer does: special
    # tokens left out, and spaces between special tokens (tokenizers that write any: slow ones).
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Token id -> a value added to its logit before sampling (OpenAI's logit_bias).
    logit_bias: dict[int, float] = {}
    # Only these tokens may be sampled (vLLM's allowed_token_ids); None allows all.
    allowed_token_ids: list[int] | None = None
    # What the caller asks for (the offline API's way in); the frontend resolves it into
    # ``grammar``, which is what travels to the workers.
    structured_outputs: StructuredOutputsParams | None = None
    # An llguidance grammar (its JSON form) every sampled token must follow.
    grammar: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.stop_token_ids, frozenset):
            msgspec.structs.force_setattr(self, "stop_token_ids", frozenset(self.stop_token_ids))
        problem = find_sampling_problem(self)
        if problem is not None:
            raise ValueError(problem)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


_INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def find_sampling_problem(p: SamplingParams) -> str | None:
    """Return a human-readable reason the parameters are invalid, or None if they are fine."""
    for name in _INT_FIELDS:
        value = getattr(p, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            # The wire carries these as integers: a float would make the frame undecodable.
            return f"{name} must be an integer, got {value!r}"
    if not 1 <= p.n <= MAX_N:
        return f"n must be between 1 and {MAX_N}, got {p.n}"
    if not _finite(p.temperature) or p.temperature < 0:
        return f"temperature must be a finite number >= 0, got {p.temperature}"
    if not _finite(p.top_p) or not 0.0 < p.top_p <= 1.0:
        return f"top_p must be in (0, 1], got {p.top_p}"
    if p.top_k < 0:
        return f"top_k must be >= 0 (0 disables it), got {p.top_k}"
    if not _finite(p.min_p) or not 0.0 <= p.min_p <= 1.0:
        return f"min_p must be in [0, 1], got {p.min_p}"
    # 0 only to score a prompt (vLLM's echo with max_tokens 0): its logprobs, nothing generated.
    least = 0 if p.prompt_logprobs is not None else 1
    if p.max_tokens is not None and p.max_tokens < least:
        return f"max_tokens must be at least {least}, got {p.max_tokens}"
    if p.min_tokens < 0:
        return f"min_tokens must be >= 0, got {p.min_tokens}"
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        return f"min_tokens ({p.min_tokens}) must not exceed max_tokens ({p.max_tokens})"
    if len(p.stop) > MAX_STOP_STRINGS:
        return f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(p.stop)}"
    if any(not s for s in p.stop):
        return "stop strings must be non-empty"
    longest = max(map(len, p.stop), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        return (
            f"stop strings may hold at most {MAX_STOP_STRING_CHARS} characters each, got one of "
            f"{longest}"
        )
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        return (
            f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} distinct ids, "
            f"got {len(p.stop_token_ids)}"
        )
    if any(not isinstance(t, int) or t < 0 for t in p.stop_token_ids):
        return "stop_token_ids must be non-negative token ids"
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(p, name)
        if value is not None and value < 0:
            return f"{name} must be >= 0, got {value}"
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not _finite(value) or not -2.0 <= value <= 2.0:
            return f"{name} must be in [-2, 2], got {value}"
    if not _finite(p.repetition_penalty) or p.repetition_penalty <= 0:
        return f"repetition_penalty must be > 0, got {p.repetition_penalty}"
    if p.seed is not None and not -(2**63) <= p.seed < 2**63:
        return "seed must fit in a signed 64-bit integer"
    if len(p.logit_bias) > MAX_LOGIT_BIAS:
        return f"logit_bias must hold at most {MAX_LOGIT_BIAS} tokens, got {len(p.logit_bias)}"
    for token_id, bias in p.logit_bias.items():
        if not isinstance(token_id, int) or token_id < 0:
            return f"logit_bias keys must be non-negative token ids, got {token_id!r}"
        if not _finite(bias) or abs(bias) > MAX_LOGIT_BIAS_VALUE:
            return f"logit_bias values must be in [-100, 100], got {bias}"
    if p.structured_outputs is not None and len(p.structured_outputs.kinds()) != 1:
        return (
            "structured_outputs must set exactly one of json, regex, choice, grammar, json_object"
        )
    if p.grammar is not None and len(p.grammar) > MAX_GRAMMAR_CHARS:
        return f"a grammar may hold at most {MAX_GRAMMAR_CHARS} characters"
    if p.allowed_token_ids is not None:
        if not p.allowed_token_ids:
            return "allowed_token_ids must not be empty"
        if len(p.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
            return f"allowed_token_ids must hold at most {MAX_ALLOWED_TOKEN_IDS} ids"
        if any(not isinstance(t, int) or t < 0 for t in p.allowed_token_ids):
            return "allowed_token_ids must be non-negative token ids"
    return None


def find_vocab_problem(
    p: SamplingParams, vocab_size: int, max_logprobs: int = MAX_LOGPROBS
) -> str | None:
    """A token id of ``p`` outside the model's vocabulary, or more logprobs than the server's
    cap (``max_logprobs``, at most the vocabulary), or None: the checks that need the model,
    made by the frontend and again by the engine."""
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(p, name)
        if value is not None and value > max_logprobs:
            return f"{name} must be between 0 and {max_logprobs} (max_logprobs), got {value}"
    for name, ids in (
        ("stop_token_ids", p.stop_token_ids),
        ("logit_bias", p.logit_bias),
        ("allowed_token_ids", p.allowed_token_ids or ()),
    ):
        if any(t >= vocab_size for t in ids):
            return f"{name} must be token ids in [0, {vocab_size})"
    return None
