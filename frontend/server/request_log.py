"""``--enable-log-requests``: one log line when a generation request arrives, one when it ends.

Runs in an HTTP frontend process, on its event loop. The arrival line names the request, its
prompts' lengths and the sampling parameters it set; the prompt itself only with
``--log-prompts`` (prompts may be private), and then at most ``PROMPT_LOG_TOKENS`` tokens of it,
so that logging a huge prompt never stalls the loop. The finish line gives each choice's finish
reason, the tokens, the time to the first token and the whole request's time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from conveyor.frontend.input_processor import Choice
from conveyor.protocol import SamplingParams

logger = logging.getLogger("conveyor.frontend.requests")

PROMPT_LOG_TOKENS = 512
_DEFAULT_PARAMS = msgspec.structs.asdict(SamplingParams())


def set_params(params: SamplingParams) -> dict[str, Any]:
    """The sampling parameters that differ from the defaults, by name."""
    return {
        name: value
        for name, value in msgspec.structs.asdict(params).items()
        if value != _DEFAULT_PARAMS.get(name)
    }


class RequestLogger:
    def __init__(self, tokenizer: Any, log_prompts: bool = False) -> None:
        self._tokenizer = tokenizer
        self._log_prompts = log_prompts

    def arrived(self, request_id: str, choices: Sequence[Choice], n: int) -> None:
        prompts = [c.request.prompt_token_ids for c in choices[::n]]
        # Each choice went to the engine with n=1 (and its own seed, if one was set).
        params = {**set_params(choices[0].request.sampling_params), "n": n}
        lengths = ", ".join(str(len(p)) for p in prompts)
        line = (
            f"request {request_id}: {len(prompts)} prompt(s) of {lengths} tokens, params {params}"
        )
        if self._log_prompts:
            line += ", prompts " + "; ".join(self._shown(p) for p in prompts)
        logger.info("%s", line)

    def _shown(self, token_ids: list[int]) -> str:
        text = repr(self._tokenizer.decode(token_ids[:PROMPT_LOG_TOKENS]))
        if len(token_ids) > PROMPT_LOG_TOKENS:
            text += f" (first {PROMPT_LOG_TOKENS} of {len(token_ids)} tokens)"
        return text

    def finished(self, request_id: str, choices: Sequence[Choice]) -> None:
        states = [c.state for c in choices]
        reasons = ", ".join(s.finish_reason or "unfinished" for s in states)
        num_generated = sum(len(s.token_ids) for s in states)
        arrival = min(s.arrival_time for s in states)
        first_tokens = [s.first_token_time for s in states if s.first_token_time is not None]
        ttft = f"{min(first_tokens) - arrival:.3f} s" if first_tokens else "none"
        logger.info(
            "request %s finished: %s, %d tokens generated, TTFT %s, E2E %.3f s",
            request_id,
            reasons,
            num_generated,
            ttft,
            time.monotonic() - arrival,
        )
