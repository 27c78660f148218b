"""Tokenizer loading and incremental detokenization with stop-string detection.

Runs in the frontend process. Text is produced a token at a time by decoding a short sliding
window and emitting only what it adds, so a streamed request costs O(1) decode work per token
instead of re-decoding its whole output. A window whose text ends in U+FFFD is an incomplete
UTF-8 sequence (a multi-byte character split across tokens): nothing is emitted until it completes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conveyor.protocol import EngineCoreOutput

# Prompt tokens kept as left context: decoders that drop a word's leading space at the start of
# a decode (SentencePiece) need a few real tokens before the first output token.
NUM_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


def load_tokenizer(model_dir: str | Path) -> Any:
    """The model directory's own Hugging Face tokenizer (local files only, never a hub)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def decode_options(
    skip_special_tokens: bool, spaces_between_special_tokens: bool
) -> dict[str, bool]:
    """The keyword arguments of ``tokenizer.decode`` for a request's detokenizing options
    (vLLM's ``skip_special_tokens`` and ``spaces_between_special_tokens``). The second is
    passed only when off: tokenizers that do not write such spaces (fast ones) need not know
    it, and the others put them in by default."""
    options = {"skip_special_tokens": skip_special_tokens}
    if not spaces_between_special_tokens:
        options["spaces_between_special_tokens"] = False
    return options


def text_token_ids(output: EngineCoreOutput, include_stop_str_in_output: bool) -> list[int]:
    """The output's tokens that become text.

    A stop token (EOS or a ``stop_token_ids`` entry: the engine's only "stop") ends the output.
    Its text is left out unless ``include_stop_str_in_output``, as vLLM does, so a stop token
    that is an ordinary word does not show; it still counts as generated (token ids, usage).
    """
    new_token_ids = output.new_token_ids
    if output.finish_reason == "stop" and new_token_ids and not include_stop_str_in_output:
        return new_token_ids[:-1]
    return new_token_ids


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas; watches for stop strings."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        options: dict[str, bool] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        # ``decode_options``: special tokens skipped unless the request says otherwise.
        self._options = options or decode_options(True, True)
        self._token_ids = list(prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        # Window [prefix_offset, read_offset) is text already emitted, used as context.
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._stop = list(stop or ())
        self._include_stop = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self.text = ""
        self.stop_reason: str | None = None
        # Output tokens taken in: after a stop string, tokens past it are not (an output may
        # carry several tokens, speculative decoding's accepted run).
        self.num_tokens_taken = 0

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Append tokens; return the stop string if one now appears (text is then truncated).

        Once stopped, later tokens add nothing: the text ends at the stop string.
        """
        if self.stop_reason is not None:
            return self.stop_reason
        for token_id in token_ids:
            self._token_ids.append(token_id)
            self.num_tokens_taken += 1
            delta = self._next_delta()
            if delta and self._check_stop(delta):
                return self.stop_reason
        return None

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, **self._options)

    def _next_delta(self) -> str:
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._token_ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return full_text[len(prefix_text) :]

    def _check_stop(self, delta: str) -> bool:
        before = len(self.text)
        self.text += delta
        if not self._stop:
            return False
        # A new match must end inside the delta, so it starts at most max_stop_len-1 before it.
        search_from = max(0, before - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self._stop:
            index = self.text.find(stop, search_from)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return False
        index, stop = best
        self.text = self.text[: index + len(stop)] if self._include_stop else self.text[:index]
        self.stop_reason = stop
        return True
