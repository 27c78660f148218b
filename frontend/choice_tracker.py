"""One choice of an HTTP request (one engine request): its tokens, text deltas and finish state.

Runs in an HTTP frontend process. Text comes from the shared ``IncrementalDetokenizer`` (O(1)
decode work per token, stop strings found there). A streamed delta holds back the last
``len(longest stop) - 1`` characters while the choice runs: they may be the start of a stop
string, which must never reach the client. When the engine ends the choice, the text is the
whole output decoded once, so it equals what ``LLM.generate`` returns for the same tokens.

A stop token's text is left out (``text_token_ids``), but its logprob row stays: logprobs, like
the token ids and usage, cover every sampled token (as vLLM's do), and a stop string's text is
cut the same way while its tokens' rows stay.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from frontend.tokenizer import IncrementalDetokenizer, text_token_ids
from protocol import FAILED_FINISH_REASONS, EngineCoreOutput, FinishReason, SamplingParams

# Per generated token: (token ids, log-probabilities), the sampled token first, then its top-k.
LogprobRow = tuple[list[int], list[float]]


@dataclass
class ChoiceDelta:
    """What one engine output added to a choice; the last delta carries the finish reason."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[LogprobRow] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class ChoiceTracker:
    def __init__(
        self,
        index: int,
        request_id: str,
        tokenizer: Any,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float,
    ) -> None:
        self.index = index
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.num_prompt_tokens = len(prompt_token_ids)
        self._tokenizer = tokenizer
        self._detokenizer = IncrementalDetokenizer(
            tokenizer,
            prompt_token_ids,
            sampling_params.stop,
            sampling_params.include_stop_str_in_output,
        )
        self._hold_chars = max((len(s) for s in sampling_params.stop), default=1) - 1
        self.token_ids: list[int] = []
        # token_ids[:num_text_tokens] make the text: all but a stop token that ended the choice.
        self.num_text_tokens = 0
        self.logprobs: list[LogprobRow] = []
        self.text = ""  # what has been handed out in deltas so far
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        # Monotonic times for the latency metrics.
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, output: EngineCoreOutput) -> ChoiceDelta:
        """Fold one engine output in; the text and tokens it added.

        A stop string ends the choice here while the engine still runs it: once ``finished``,
        the caller must close the choice's stream (which aborts it in the engine).
        """
        new_token_ids = output.new_token_ids
        if new_token_ids:
            now = time.monotonic()
            if self.first_token_time is None:
                self.first_token_time = now
            self.last_token_time = now
        self.token_ids.extend(new_token_ids)
        rows: list[LogprobRow] = []
        if output.logprobs is not None:
            rows = list(zip(output.logprobs.token_ids, output.logprobs.logprobs))
            self.logprobs.extend(rows)
        text_ids = text_token_ids(output, self.sampling_params.include_stop_str_in_output)
        self.num_text_tokens += len(text_ids)
        stop_string = None
        if output.finish_reason not in FAILED_FINISH_REASONS:
            stop_string = self._detokenizer.add_tokens(text_ids)
        if stop_string is not None:
            self.finish_reason, self.stop_reason = "stop", stop_string
        elif output.finish_reason is not None:
            self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason
        delta = ChoiceDelta(self.index, self._next_text(stop_string), new_token_ids, rows)
        delta.finish_reason, delta.stop_reason = self.finish_reason, self.stop_reason
        return delta

    def _next_text(self, stop_string: str | None) -> str:
        text = self._detokenizer.text
        if self.finish_reason is None:
            end = len(text) - self._hold_chars
        else:
            if stop_string is None and self.finish_reason not in FAILED_FINISH_REASONS:
                # Decoded whole once: an incomplete character the window held back comes out.
                text_ids = self.token_ids[: self.num_text_tokens]
                whole = self._tokenizer.decode(text_ids, skip_special_tokens=True)
                if whole.startswith(self.text):
                    text = whole
            end = len(text)
        if end <= len(self.text):
            return ""
        delta = text[len(self.text) : end]
        self.text += delta
        return delta
