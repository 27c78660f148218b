"""Per engine request: the tokens, text, logprobs and finish state the frontend builds up.

Runs in the frontend process. One ``SampleTracker`` follows one engine request (one of the n
samples of a prompt). It folds each ``EngineCoreOutput`` in and decides when a stop string ends
the sample, in which case the caller must abort the request in the engine.
"""

from __future__ import annotations

from typing import Any

from frontend.outputs import CompletionOutput, PositionLogprobs
from frontend.tokenizer import IncrementalDetokenizer, text_token_ids
from protocol import FAILED_FINISH_REASONS, EngineCoreOutput, FinishReason, Logprobs, SamplingParams


class SampleTracker:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        index: int,
    ) -> None:
        self.index = index
        self.sampling_params = sampling_params
        self._tokenizer = tokenizer
        self.token_ids: list[int] = []
        # token_ids[:num_text_tokens] make the text: all but a stop token that ended the sample
        # (its logprobs stay, as on the HTTP path).
        self.num_text_tokens = 0
        self.logprobs: list[PositionLogprobs] | None = (
            [] if sampling_params.logprobs is not None else None
        )
        self.cumulative_logprob: float | None = (
            0.0 if sampling_params.logprobs is not None else None
        )
        # Only stop strings need text while generating; otherwise it is decoded once at the end.
        self._detokenizer: IncrementalDetokenizer | None = None
        if sampling_params.stop:
            self._detokenizer = IncrementalDetokenizer(
                tokenizer,
                prompt_token_ids,
                sampling_params.stop,
                sampling_params.include_stop_str_in_output,
            )
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, output: EngineCoreOutput) -> bool:
        """Fold one engine output in; True when a stop string ended the sample here.

        A True return means the engine does not know the sample is over: abort it there.
        """
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        self.token_ids.extend(output.new_token_ids)
        text_ids = text_token_ids(output, self.sampling_params.include_stop_str_in_output)
        self.num_text_tokens += len(text_ids)
        if output.logprobs is not None and self.logprobs is not None:
            self._add_logprobs(output.logprobs)
        if self._detokenizer is not None and output.finish_reason not in FAILED_FINISH_REASONS:
            stop = self._detokenizer.add_tokens(text_ids)
            if stop is not None:
                self.finish_reason, self.stop_reason = "stop", stop
                return output.finish_reason is None
        if output.finish_reason is not None:
            self.finish_reason = output.finish_reason
            self.stop_reason = output.stop_reason
        return False

    def _add_logprobs(self, logprobs: Logprobs) -> None:
        assert self.logprobs is not None and self.cumulative_logprob is not None
        for token_ids, values in zip(logprobs.token_ids, logprobs.logprobs):
            if not token_ids:
                continue
            # The sampled token is first; it may also appear among the top-k with the same value.
            self.logprobs.append(dict(zip(token_ids, values)))
            self.cumulative_logprob += values[0]

    def to_output(self) -> CompletionOutput:
        if self._detokenizer is not None:
            text = self._detokenizer.text
        else:
            text_ids = self.token_ids[: self.num_text_tokens]
            text = self._tokenizer.decode(text_ids, skip_special_tokens=True)
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
