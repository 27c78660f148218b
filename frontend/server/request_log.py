"""``--enable-log-requests``: one log line when a generation request arrives, one when it ends.

Runs in an HTTP frontend process, on its event loop. The arrival line names the request, its
prompts' lengths and the sampling parameters it set; the prompt itself only with
``--log-prompts`` (prompts may be private). The finish line gives each choice's finish reason,
the tokens, the time to the first token and the whole request's time.

What a client sends ends up in these lines, so each stays within ``MAX_LINE_BYTES`` whatever the
request: every value is cut before it is formatted (a few items of a list or a dict, the start of
a string, each with its full size; a grammar by kind, size and hash, never its text), and the
line as a whole at the end. A request whose line costs more than a few microseconds to make (a
large grammar to hash, prompts to decode) has it made on the frontend's CPU pool.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec

from conveyor.frontend.input_processor import Choice
from conveyor.protocol import SamplingParams

logger = logging.getLogger("conveyor.frontend.requests")

# A log line's most bytes (UTF-8): its message is cut to leave room for the time, process and
# logger name the log format puts before it.
MAX_LINE_BYTES = 8 << 10
MAX_MESSAGE_BYTES = MAX_LINE_BYTES - 256
_CUT_MARK = " ...(line cut)"
# What one value shows: items of a list, set or dict; characters of a string; nesting levels.
ITEMS_SHOWN = 8
CHARS_SHOWN = 64
DEPTH_SHOWN = 2
# Prompt lengths listed (the rest counted); with --log-prompts, the prompts shown, the tokens
# decoded of each and the characters kept of that.
LENGTHS_SHOWN = 16
PROMPTS_SHOWN = 4
PROMPT_LOG_TOKENS = 512
PROMPT_LOG_CHARS = 1024
# Hashing a grammar runs at about a GB/s and decoding at about 1 us per token: beyond these, the
# line is made off the event loop.
LOOP_GRAMMAR_CHARS = 1 << 16
LOOP_DECODE_TOKENS = 256

_DEFAULT_PARAMS = msgspec.structs.asdict(SamplingParams())
# llguidance's grammar JSON names its kind first ({"grammars":[{"name":"json_schema",...); a bare
# Lark text has no such prefix.
_GRAMMAR_KIND = re.compile(r'\{\s*"grammars"\s*:\s*\[\s*\{\s*"name"\s*:\s*"(\w{1,32})"')

RunCpu = Callable[..., Awaitable[Any]]


def set_params(params: SamplingParams) -> dict[str, Any]:
    """The sampling parameters that differ from the defaults, by name."""
    return {
        name: value
        for name, value in msgspec.structs.asdict(params).items()
        if value != _DEFAULT_PARAMS.get(name)
    }


def shown(value: Any, depth: int = 0) -> str:
    """``value`` as a log line shows it: ``repr`` for a small one; at most ``ITEMS_SHOWN`` items
    of a collection and ``CHARS_SHOWN`` characters of a string, each with its full size."""
    if isinstance(value, str):
        if len(value) <= CHARS_SHOWN:
            return repr(value)
        return f"{value[:CHARS_SHOWN]!r}...({len(value)} chars)"
    if isinstance(value, msgspec.Struct):
        value = msgspec.structs.asdict(value)
    if isinstance(value, (dict, list, tuple, set, frozenset)):
        if depth >= DEPTH_SHOWN:
            return f"<{type(value).__name__} of {len(value)}>"
        if isinstance(value, dict):
            items = [
                f"{shown(k, depth + 1)}: {shown(v, depth + 1)}"
                for k, v in itertools.islice(value.items(), ITEMS_SHOWN)
            ]
            opening, closing = "{", "}"
        else:
            items = [shown(v, depth + 1) for v in itertools.islice(value, ITEMS_SHOWN)]
            opening, closing = ("(", ")") if isinstance(value, tuple) else ("[", "]")
        if len(value) > ITEMS_SHOWN:
            items.append(f"...({len(value)} items)")
        return opening + ", ".join(items) + closing
    text = repr(value)  # a number, a bool, None
    return text if len(text) <= CHARS_SHOWN else text[:CHARS_SHOWN] + "..."


def grammar_shown(grammar: str) -> str:
    """A grammar by kind, size and hash: the same constraint sent again logs the same."""
    match = _GRAMMAR_KIND.match(grammar[:256])
    kind = match[1] if match else "lark"
    digest = hashlib.blake2b(grammar.encode(), digest_size=8).hexdigest()
    return f"<{kind} grammar, {len(grammar)} chars, blake2b {digest}>"


def cut_line(line: str, max_bytes: int = MAX_MESSAGE_BYTES) -> str:
    """``line`` within ``max_bytes`` of UTF-8, marked where it was cut."""
    if len(line) * 4 <= max_bytes:
        return line  # no character takes more than 4 bytes
    data = line.encode()
    if len(data) <= max_bytes:
        return line
    keep = data[: max_bytes - len(_CUT_MARK)].decode(errors="ignore")
    return keep + _CUT_MARK


class RequestLogger:
    def __init__(self, tokenizer: Any, log_prompts: bool = False) -> None:
        self._tokenizer = tokenizer
        self._log_prompts = log_prompts

    async def arrived(
        self, request_id: str, choices: Sequence[Choice], n: int, run_cpu: RunCpu
    ) -> None:
        """Log the arrival line, made on the CPU pool (``run_cpu``) when that costs more than a
        few microseconds."""
        if self._costly(choices, n):
            line = await run_cpu(self.arrival_line, request_id, choices, n)
        else:
            line = self.arrival_line(request_id, choices, n)
        logger.info("%s", line)

    def _costly(self, choices: Sequence[Choice], n: int) -> bool:
        grammar = choices[0].request.sampling_params.grammar
        if grammar is not None and len(grammar) > LOOP_GRAMMAR_CHARS:
            return True
        if not self._log_prompts:
            return False
        prompts = [c.request.prompt_token_ids for c in choices[::n][:PROMPTS_SHOWN]]
        return sum(min(len(p), PROMPT_LOG_TOKENS) for p in prompts) > LOOP_DECODE_TOKENS

    def arrival_line(self, request_id: str, choices: Sequence[Choice], n: int) -> str:
        """The arrival line's message, within ``MAX_MESSAGE_BYTES``."""
        prompts = [c.request.prompt_token_ids for c in choices[::n]]
        # Each choice went to the engine with n=1 (and its own seed, if one was set).
        params = {**set_params(choices[0].request.sampling_params), "n": n}
        line = (
            f"request {request_id}: {len(prompts)} prompt(s) of {_lengths(prompts)} tokens, "
            f"params {_params_shown(params)}"
        )
        if self._log_prompts:
            shown_prompts = "; ".join(self._prompt_shown(p) for p in prompts[:PROMPTS_SHOWN])
            line += ", prompts " + shown_prompts
            if len(prompts) > PROMPTS_SHOWN:
                line += f" (first {PROMPTS_SHOWN} of {len(prompts)} prompts)"
        return cut_line(line)

    def _prompt_shown(self, token_ids: list[int]) -> str:
        text = self._tokenizer.decode(token_ids[:PROMPT_LOG_TOKENS])
        cut = len(token_ids) > PROMPT_LOG_TOKENS or len(text) > PROMPT_LOG_CHARS
        shown_text = repr(text[:PROMPT_LOG_CHARS])
        if cut:
            shown_text += f" (the start of {len(token_ids)} tokens)"
        return shown_text

    def finished(self, request_id: str, choices: Sequence[Choice]) -> None:
        states = [c.state for c in choices]
        reasons = [s.finish_reason or "unfinished" for s in states]
        if len(reasons) <= ITEMS_SHOWN:
            reasons_shown = ", ".join(reasons)
        else:
            reasons_shown = ", ".join(f"{r} x{k}" for r, k in Counter(reasons).items())
        num_generated = sum(len(s.token_ids) for s in states)
        arrival = min(s.arrival_time for s in states)
        first_tokens = [s.first_token_time for s in states if s.first_token_time is not None]
        ttft = f"{min(first_tokens) - arrival:.3f} s" if first_tokens else "none"
        logger.info(
            "request %s finished: %s, %d tokens generated, TTFT %s, E2E %.3f s",
            request_id,
            reasons_shown,
            num_generated,
            ttft,
            time.monotonic() - arrival,
        )


def _lengths(prompts: list[list[int]]) -> str:
    lengths = ", ".join(str(len(p)) for p in prompts[:LENGTHS_SHOWN])
    if len(prompts) > LENGTHS_SHOWN:
        lengths += f", ...({sum(len(p) for p in prompts)} in all)"
    return lengths


def _params_shown(params: dict[str, Any]) -> str:
    items = []
    for name, value in params.items():
        text = grammar_shown(value) if name == "grammar" and value else shown(value)
        items.append(f"{name!r}: {text}")
    return "{" + ", ".join(items) + "}"
