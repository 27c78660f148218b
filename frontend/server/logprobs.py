"""Engine logprob rows -> the two OpenAI formats (legacy completions, chat ``content``).

Runs in an HTTP frontend process. A row is (token ids, logprobs): the sampled token first, then
the top-k alternatives from the raw model distribution. Tokens are shown as their decoded text,
or with vLLM's ``return_tokens_as_token_ids`` as ``token_id:{id}`` (text that may not survive
JSON: half a multi-byte character, for one, can still be told apart).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from conveyor.frontend.output_processor import LogprobRow
from conveyor.frontend.server.response_models import (
    ChatLogprobEntry,
    CompletionLogprobs,
    PromptLogprob,
    TopLogprob,
)
from conveyor.protocol import Logprobs


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])


def shown_token(tokenizer: Any, token_id: int, as_token_id: bool) -> str:
    return f"token_id:{token_id}" if as_token_id else token_text(tokenizer, token_id)


def completion_logprobs(
    tokenizer: Any,
    rows: Sequence[LogprobRow],
    num_top: int,
    text_offset: int,
    as_token_ids: bool = False,
) -> tuple[CompletionLogprobs, int]:
    """The completions format for ``rows``, text offsets starting at ``text_offset``; also
    returns the offset after the last token, for the next streamed chunk."""
    result = CompletionLogprobs([], [], [], [])
    for token_ids, logprobs in rows:
        text = token_text(tokenizer, token_ids[0])
        shown = f"token_id:{token_ids[0]}" if as_token_ids else text
        result.tokens.append(shown)
        result.token_logprobs.append(logprobs[0])
        # vLLM's shape: the sampled token plus the top-k (up to k + 1 entries).
        top = {
            shown_token(tokenizer, t, as_token_ids): v
            for t, v in zip(token_ids[1 : num_top + 1], logprobs[1:])
        }
        top.setdefault(shown, logprobs[0])
        result.top_logprobs.append(top)
        result.text_offset.append(text_offset)
        text_offset += len(text)
    return result, text_offset


def chat_logprobs(
    tokenizer: Any, rows: Sequence[LogprobRow], num_top: int, as_token_ids: bool = False
) -> list[ChatLogprobEntry]:
    entries = []
    for token_ids, logprobs in rows:
        text = shown_token(tokenizer, token_ids[0], as_token_ids)
        top = [
            _top_logprob(shown_token(tokenizer, t, as_token_ids), v)
            for t, v in zip(token_ids[1 : num_top + 1], logprobs[1:])
        ]
        entries.append(ChatLogprobEntry(text, logprobs[0], list(text.encode()), top))
    return entries


def _top_logprob(text: str, logprob: float) -> TopLogprob:
    return TopLogprob(text, logprob, list(text.encode()))


def echoed_prompt_logprobs(
    tokenizer: Any, prompt_token_ids: Sequence[int], rows: Logprobs, num_top: int
) -> tuple[CompletionLogprobs, int]:
    """The completions format for an echoed prompt: its first token has no logprob (nothing
    predicts it), each later one its own and its top rivals'; also the text offset after it."""
    first = token_text(tokenizer, prompt_token_ids[0])
    rest, offset = completion_logprobs(
        tokenizer, list(zip(rows.token_ids, rows.logprobs)), num_top, len(first)
    )
    return join_completion_logprobs(CompletionLogprobs([first], [None], [None], [0]), rest), offset


def join_completion_logprobs(
    head: CompletionLogprobs, tail: CompletionLogprobs | None
) -> CompletionLogprobs:
    """``head``'s tokens, then ``tail``'s."""
    if tail is None:
        return head
    return CompletionLogprobs(
        head.tokens + tail.tokens,
        head.token_logprobs + tail.token_logprobs,
        head.top_logprobs + tail.top_logprobs,
        head.text_offset + tail.text_offset,
    )


def prompt_logprobs_entries(
    tokenizer: Any, rows: Logprobs, num_top: int
) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then per token a map from
    each token id (itself and its top rivals) to its logprob, rank and text."""
    entries: list[dict[str, PromptLogprob] | None] = [None]
    for token_ids, logprobs, rank in zip(rows.token_ids, rows.logprobs, rows.ranks):
        entry = {
            str(token_ids[0]): PromptLogprob(logprobs[0], rank, token_text(tokenizer, token_ids[0]))
        }
        for place, (token_id, value) in enumerate(zip(token_ids[1 : num_top + 1], logprobs[1:]), 1):
            entry.setdefault(
                str(token_id), PromptLogprob(value, place, token_text(tokenizer, token_id))
            )
        entries.append(entry)
    return entries
