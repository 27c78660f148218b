"""Structured outputs, worker side: one grammar matcher per request, a token mask per step.

Runs in worker processes. Why here and not in the engine core (where vLLM keeps its matchers and
ships a bitmask with every step): the worker samples every token itself and appends it to its own
mirror of the request, so a matcher kept beside that mirror advances with exactly the tokens
sampled, in order, with nothing on the wire. That stays right wherever the engine core is:

* async scheduling: the engine schedules step N+1 before step N's tokens are back, but the
  worker runs steps in order, and step N's token is in the matcher before N+1 samples;
* chunked prefill: only rows that sample this step get a mask;
* preemption: a preempted request keeps its ``RequestState`` (and so its matcher) in the
  worker; on resume it recomputes its KV and samples its next token, the matcher is where it was;
* ``n > 1``: each choice is its own request with its own matcher;
* tensor parallelism: every rank samples the same token from the same logits, with the same
  mask, so every rank's matcher agrees;
* stop strings: the frontend aborts the request; its matcher goes with its state.

The grammar (llguidance's JSON or Lark text) was checked by the frontend; a matcher that still
fails (a client writing to the engine socket directly) lets only EOS through, so the request
ends at once instead of failing the worker. llguidance builds masks on demand, in its own
threads and without the GIL (``fill_next_token_bitmask_par``), so there is no compile step to
wait for.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)


class GrammarRuntime:
    """The llguidance tokenizer (loaded on a thread from the moment this is made) and the
    per-step masks."""

    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._model_dir = model_dir
        self._tokenizer: Any = None
        self._error: BaseException | None = None
        self._executor: Any = None
        # Loading a tokenizer takes a while: on a thread, beside the first structured request's
        # prompt computation rather than in front of its first sampling step.
        self._loaded = threading.Event()
        threading.Thread(target=self._load, name="grammar-tokenizer", daemon=True).start()

    def _load(self) -> None:
        try:
            from llguidance import LLExecutor
            from llguidance.hf import from_tokenizer
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(self._model_dir, local_files_only=True)
            eos = self._eos_token_ids or None
            self._tokenizer = from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=eos)
            self._executor = LLExecutor()
        except BaseException as exc:  # reported when a structured request needs it
            self._error = exc
        finally:
            self._loaded.set()

    def new_matcher(self, grammar: str) -> Any:
        """A matcher at the start of ``grammar``."""
        from llguidance import LLMatcher

        self._loaded.wait()
        if self._error is not None:
            raise RuntimeError(f"structured outputs are unavailable: {self._error}")
        matcher = LLMatcher(self._tokenizer, grammar, log_level=1)
        if matcher.is_error():
            logger.warning("a grammar failed in the worker (EOS only): %s", matcher.get_error())
        return matcher

    def bitmask(self, rows: list[tuple[int, Any]]) -> torch.Tensor:
        """[len(rows), ceil(V / 32)] int32: the allowed tokens of each listed row, in order (a
        matcher in error allows only EOS)."""
        # All bits set: every token allowed. (llguidance.torch has these helpers, but importing
        # it compiles a kernel with torch.compile: seconds of start-up for two lines.)
        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
        healthy = [(m, i) for i, (_, m) in enumerate(rows) if not m.is_error()]
        if healthy:
            # Rust threads fill each listed row of the contiguous host buffer, GIL released.
            self._executor.unsafe_compute_mask_ptr(
                healthy, bitmask.data_ptr(), words * 4, len(rows)
            )
        for row, (_, matcher) in enumerate(rows):
            if matcher.is_error():
                bitmask[row] = 0
                for eos in self._eos_token_ids:
                    word = int(bitmask[row, eos // 32]) | (1 << (eos % 32))
                    bitmask[row, eos // 32] = word - (1 << 32) if word >= 1 << 31 else word
        return bitmask

    @staticmethod
    def accept(matcher: Any, token_id: int) -> None:
        """Advance past a sampled token (after the grammar ended, EOS and the like: ignored)."""
        if not matcher.is_error() and not matcher.is_stopped():
            matcher.consume_token(token_id)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set every token a row's bitmask leaves out to -inf, in place (bit t % 32 of word t // 32
    says whether token t is allowed)."""
    bitmask = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    vocab_size = logits.shape[-1]
    logits.masked_fill_(~allowed[:, :vocab_size], float("-inf"))
