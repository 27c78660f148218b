"""Engine outputs -> what a caller sees: per choice, its tokens, text, logprobs and finish state.

Runs in the frontend process, for both the offline ``LLM`` and the HTTP server. A choice is one
engine request: one of the n samples of one prompt. ``ChoiceState`` folds each ``EngineCoreOutput``
of its request in and returns a ``ChoiceDelta`` (what that output added); ``OutputProcessor`` holds
the choices of one call (an ``LLM.generate`` batch, an HTTP request) and routes outputs to them.

Text comes from the ``IncrementalDetokenizer`` (O(1) decode work per token, stop strings found
there) when the caller streams or a stop string must be watched for; otherwise it is decoded once
when the choice ends, which costs nothing per token. A streamed delta holds back the last
``len(longest stop) - 1`` characters while the choice runs: they may be the start of a stop
string, which must never reach the client. When the engine ends a choice, its text is the whole
output decoded once, so streamed and whole responses, and ``LLM.generate``, end with equal text.

A stop token's text is left out (``text_token_ids``), but its logprob row stays: logprobs, like
the token ids and usage, cover every sampled token (as vLLM's do), and a stop string's text is
cut the same way while its tokens' rows stay.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from conveyor.frontend.outputs import CompletionOutput
from conveyor.frontend.tokenizer import IncrementalDetokenizer, decode_options, text_token_ids
from conveyor.protocol import (
    FAILED_FINISH_REASONS,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    Logprobs,
    SamplingParams,
)

# Per generated token: (token ids, log-probabilities), the sampled token first, then its top-k.
LogprobRow = tuple[list[int], list[float]]
# An output whose text takes more tokens than this to decode is decoded off an event loop (a
# whole decode runs at about 4 tokens per microsecond: this is a quarter of a millisecond).
MAX_DECODE_TOKENS_ON_LOOP = 1024


@dataclass(slots=True)
class ChoiceDelta:
    """What one engine output added to a choice; the last delta carries the finish reason."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[LogprobRow] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class ChoiceState:
    """One choice (one engine request) from its first output to its last."""

    def __init__(
        self,
        index: int,
        request_id: str,
        tokenizer: Any,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float,
        stream: bool,
    ) -> None:
        self.index = index
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.prompt_token_ids = prompt_token_ids
        self._tokenizer = tokenizer
        self._decode_options = decode_options(
            sampling_params.skip_special_tokens, sampling_params.spaces_between_special_tokens
        )
        self._detokenizer: IncrementalDetokenizer | None = None
        if stream or sampling_params.stop:
            self._detokenizer = IncrementalDetokenizer(
                tokenizer,
                prompt_token_ids,
                sampling_params.stop,
                sampling_params.include_stop_str_in_output,
                self._decode_options,
            )
        self._hold_chars = max((len(s) for s in sampling_params.stop), default=1) - 1
        self.token_ids: list[int] = []
        # token_ids[:num_text_tokens] make the text: all but a stop token that ended the choice.
        self.num_text_tokens = 0
        self.logprobs: list[LogprobRow] = []
        # With the first output, when the request asked for prompt logprobs (rows from the
        # prompt's second token on; ranks included).
        self.prompt_logprobs: Logprobs | None = None
        self.text = ""  # what has been handed out in deltas so far
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        # A stop string ended the choice while the engine still runs it: abort it there.
        self.stopped_by_frontend = False
        self.num_cached_tokens = 0
        # Monotonic times for the latency metrics.
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, output: EngineCoreOutput) -> ChoiceDelta:
        """Fold one engine output in; the text and tokens it added.

        After a stop string (``stopped_by_frontend``) the engine does not know the choice is
        over: the caller must abort it there.
        """
        num_rows, num_tokens = len(self.logprobs), len(self.token_ids)
        text = self.fold(output)
        new_token_ids = self.token_ids[num_tokens:]
        delta = ChoiceDelta(self.index, text, new_token_ids, self.logprobs[num_rows:])
        delta.finish_reason, delta.stop_reason = self.finish_reason, self.stop_reason
        return delta

    def decode_cost(self, output: EngineCoreOutput) -> int:
        """How many tokens folding ``output`` in decodes: its own, one by one, if they are
        streamed or watched for stop strings, and the whole text if it ends the choice."""
        num_tokens = len(output.new_token_ids) if self._detokenizer is not None else 0
        if output.finish_reason is not None:
            num_tokens += self.num_text_tokens + len(output.new_token_ids)
        return num_tokens

    def fold(self, output: EngineCoreOutput) -> str:
        """``update`` without the delta: the text the output added (a batch caller that reads
        the choice only when it ends need not pay for a delta per token)."""
        new_token_ids = output.new_token_ids
        if new_token_ids:
            now = time.monotonic()
            if self.first_token_time is None:
                self.first_token_time = now
            self.last_token_time = now
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        self.token_ids.extend(new_token_ids)
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        if output.logprobs is not None:
            self.logprobs.extend(zip(output.logprobs.token_ids, output.logprobs.logprobs))
        text_ids = text_token_ids(output, self.sampling_params.include_stop_str_in_output)
        self.num_text_tokens += len(text_ids)
        stop_string = None
        if self._detokenizer is not None and output.finish_reason not in FAILED_FINISH_REASONS:
            taken = self._detokenizer.num_tokens_taken
            stop_string = self._detokenizer.add_tokens(text_ids)
            if stop_string is not None:
                self._drop_past_stop(len(text_ids) - self._detokenizer.num_tokens_taken + taken)
        if stop_string is not None:
            self.finish_reason, self.stop_reason = "stop", stop_string
            self.stopped_by_frontend = output.finish_reason is None
        elif output.finish_reason is not None:
            self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason
        return self._next_text(stop_string)

    def _drop_past_stop(self, num_unused: int) -> None:
        """Forget the output's tokens after the one that completed a stop string: several
        tokens arrive at once under speculative decoding, and the choice ends where one token
        at a time would have ended it."""
        if num_unused <= 0:
            return
        del self.token_ids[-num_unused:]
        self.num_text_tokens -= num_unused
        if self.logprobs and self.sampling_params.logprobs is not None:
            del self.logprobs[-num_unused:]

    def _next_text(self, stop_string: str | None) -> str:
        if self.finish_reason is None:
            if self._detokenizer is None:
                return ""  # decoded once, at the end
            end = len(self._detokenizer.text) - self._hold_chars
            return self._hand_out(self._detokenizer.text, end)
        if stop_string is not None or self.finish_reason in FAILED_FINISH_REASONS:
            text = self._detokenizer.text if self._detokenizer is not None else ""
            return self._hand_out(text, len(text))
        # Decoded whole once: an incomplete character the window held back comes out.
        whole = self._tokenizer.decode(
            self.token_ids[: self.num_text_tokens], **self._decode_options
        )
        if not whole.startswith(self.text) and self._detokenizer is not None:
            whole = self._detokenizer.text
        return self._hand_out(whole, len(whole))

    def _hand_out(self, text: str, end: int) -> str:
        if end <= len(self.text):
            return ""
        delta = text[len(self.text) : end]
        self.text += delta
        return delta

    def to_completion_output(self) -> CompletionOutput:
        """The offline API's view of the choice (vLLM's ``CompletionOutput`` fields)."""
        logprobs = cumulative = None
        if self.sampling_params.logprobs is not None:
            logprobs, cumulative = [], 0.0
            for token_ids, values in self.logprobs:
                if token_ids:
                    # The sampled token is first; it may also be among the top-k, same value.
                    logprobs.append(dict(zip(token_ids, values)))
                    cumulative += values[0]
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.token_ids),
            cumulative_logprob=cumulative,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclass
class ProcessedOutputs:
    num_new_tokens: int = 0
    # Choices that ended in this batch.
    finished: list[ChoiceState] = field(default_factory=list)
    # Request ids a stop string ended: the engine still runs them, abort them there.
    to_abort: list[str] = field(default_factory=list)


class OutputProcessor:
    """The choices of one call, by request id; engine outputs in, deltas out."""

    def __init__(self, choices: Iterable[ChoiceState]) -> None:
        self.choices = list(choices)
        self._by_request_id = {choice.request_id: choice for choice in self.choices}
        self.num_unfinished = len(self.choices)

    def process_output(self, output: EngineCoreOutput) -> ChoiceDelta | None:
        """Fold one output into its choice; None if it is not ours or the choice already ended."""
        choice = self._unfinished_choice(output)
        if choice is None:
            return None
        return self._counted(choice, choice.update(output))

    async def process_output_off_loop(
        self,
        output: EngineCoreOutput,
        run_cpu: Callable[
            [Callable[[EngineCoreOutput], ChoiceDelta], EngineCoreOutput], Awaitable[ChoiceDelta]
        ],
    ) -> ChoiceDelta | None:
        """``process_output`` for an event loop: a large decode (a long choice's whole text at
        its end, a burst of streamed tokens) runs in ``run_cpu`` (a thread; the tokenizer's
        decode releases the GIL), so the loop's other streams do not wait for it.

        Only the choice is touched off the loop; its outputs are folded one at a time by one
        caller, and the processor's own bookkeeping stays on the loop.
        """
        choice = self._unfinished_choice(output)
        if choice is None:
            return None
        if choice.decode_cost(output) <= MAX_DECODE_TOKENS_ON_LOOP:
            delta = choice.update(output)
        else:
            delta = await run_cpu(choice.update, output)
        return self._counted(choice, delta)

    def _unfinished_choice(self, output: EngineCoreOutput) -> ChoiceState | None:
        choice = self._by_request_id.get(output.request_id)
        if choice is None or choice.finished:
            return None
        return choice

    def _counted(self, choice: ChoiceState, delta: ChoiceDelta) -> ChoiceDelta:
        if choice.finished:
            self.num_unfinished -= 1
        return delta

    def process_outputs(self, outputs: EngineCoreOutputs) -> ProcessedOutputs:
        """Fold a batch of engine outputs in, for a caller that reads whole choices at the end
        (``LLM.generate``): what ended, and what to abort, but no delta per output."""
        processed = ProcessedOutputs()
        by_request_id = self._by_request_id
        for output in outputs.outputs:
            choice = by_request_id.get(output.request_id)
            if choice is None or choice.finished:
                continue
            choice.fold(output)
            processed.num_new_tokens += len(output.new_token_ids)
            if choice.finished:
                self.num_unfinished -= 1
                processed.finished.append(choice)
                if choice.stopped_by_frontend:
                    processed.to_abort.append(choice.request_id)
        return processed

    def choice(self, request_id: str) -> ChoiceState:
        return self._by_request_id[request_id]

    def unfinished_request_ids(self) -> list[str]:
        return [c.request_id for c in self.choices if not c.finished]
