"""What the offline API returns: one ``RequestOutput`` per prompt, one ``CompletionOutput`` per sample.

Runs in the frontend process. Plain dataclasses shaped like vLLM's, so code written against
``vllm.LLM.generate`` reads the same fields here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.protocol import FinishReason, Logprobs

# Per generated position: token id -> log-probability (the sampled token and its top-k rivals).
PositionLogprobs = dict[int, float]


def prompt_position_logprobs(logprobs: Logprobs) -> list[PositionLogprobs | None]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token (nothing predicts it), then
    per token its own log-probability and its top alternatives'."""
    rows = zip(logprobs.token_ids, logprobs.logprobs)
    return [None, *(dict(zip(token_ids, values)) for token_ids, values in rows)]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # Sum of the sampled tokens' log-probabilities; None unless logprobs were asked for.
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: FinishReason | None = None
    # The stop string or stop token id that ended the sample, or an error message.
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    # Prompt tokens served from the prefix cache (the largest over the n samples).
    num_cached_tokens: int = 0
    # With SamplingParams(prompt_logprobs=k): per prompt token, None for the first.
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)
