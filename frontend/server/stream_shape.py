"""How a stream's deltas become chunks: vLLM's ``stream_interval`` and
``stream_options.continuous_usage_stats``.

Runs in an HTTP frontend process, on its event loop. ``stream_interval`` k sends a choice's
tokens k at a time: its first delta goes out at once (the first token is never held back), later
ones are held until together they hold k tokens or the choice ends. With
``continuous_usage_stats`` (and ``include_usage``), every chunk carries its choice's usage so
far, as vLLM counts it: the choice's prompt and the tokens it has generated.
"""

from __future__ import annotations

from collections.abc import Sequence

from conveyor.frontend.output_processor import ChoiceDelta, ChoiceState
from conveyor.frontend.server.response_models import UsageInfo


class StreamShape:
    """One stream's batching and per-chunk usage; ``take`` every delta in arrival order."""

    def __init__(
        self, choices: Sequence[ChoiceState], interval: int | None, continuous_usage: bool
    ) -> None:
        self._choices = choices
        self._interval = interval or 1
        self._continuous_usage = continuous_usage
        self._held: dict[int, ChoiceDelta] = {}
        self._started: set[int] = set()
        # Tokens each choice has generated so far (by the deltas taken, not the choice's state,
        # which may be ahead of a delta that waited in a merged stream).
        self._num_tokens = [0] * len(choices)

    def take(self, delta: ChoiceDelta) -> ChoiceDelta | None:
        """The delta to send now (merged with what was held for its choice), or None."""
        self._num_tokens[delta.index] += len(delta.token_ids)
        if self._interval == 1:
            return delta
        held = self._held.pop(delta.index, None)
        if held is not None:
            delta = _merged(held, delta)
        first = delta.index not in self._started
        self._started.add(delta.index)
        if first or delta.finish_reason is not None or len(delta.token_ids) >= self._interval:
            return delta
        self._held[delta.index] = delta
        return None

    def usage(self, index: int) -> UsageInfo | None:
        """The usage a chunk of choice ``index`` carries (None without continuous usage)."""
        if not self._continuous_usage:
            return None
        num_prompt = self._choices[index].num_prompt_tokens
        num_generated = self._num_tokens[index]
        return UsageInfo(num_prompt, num_generated, num_prompt + num_generated)


def _merged(first: ChoiceDelta, then: ChoiceDelta) -> ChoiceDelta:
    return ChoiceDelta(
        first.index,
        first.text + then.text,
        first.token_ids + then.token_ids,
        first.logprobs + then.logprobs,
        then.finish_reason,
        then.stop_reason,
    )
