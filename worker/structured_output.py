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

The grammar (llguidance's JSON or Lark text) was checked by the frontend, but some failures
only show at a later token (a row of more alternatives than llguidance allows, a grammar with no
finite string): a matcher in error fails its request (``ModelRunnerOutput.failed_req_ids``, an
"error" finish naming the reason), never a quiet EOS that would read as a finished answer.

Building a matcher for a large grammar takes a while (up to a second), so it never happens
inside a step: the engine sends a structured request's grammar ahead (``SchedulerOutput.grammars``)
and holds the request back until a worker reports it built (``prepare_for``, ``take_ready``);
the build runs on a thread of its own, once per grammar text (a request's n choices and the same
schema sent again copy the built template), and the step only copies the template. llguidance
computes masks on demand, in its own threads and without the GIL.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from conveyor.protocol.sampling_params import GRAMMAR_LIMITS

logger = logging.getLogger(__name__)

# Built grammars kept for the next request that uses one (a copy costs microseconds).
_TEMPLATES_KEPT = 64
# An error's reason goes to the client and the logs: its first line is the message.
_MAX_REASON_CHARS = 500


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
        # transformers resolves its names lazily, and one thread's lookup while another imports
        # it can fail ("has no attribute 'PreTrainedTokenizerFast'"): resolved here, first.
        from llguidance.hf import from_tokenizer
        from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401

        self._auto_tokenizer, self._from_tokenizer = AutoTokenizer, from_tokenizer
        threading.Thread(target=self._load, name="grammar-tokenizer", daemon=True).start()
        # One thread: builds are rare and large; they must not take the cores from the steps.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-build")
        self._templates: OrderedDict[str, Future[Any]] = OrderedDict()
        self._templates_lock = threading.Lock()
        # Requests whose grammar is built, not yet reported to the engine (which holds them
        # back until then); notified when one is added.
        self._ready: list[int] = []
        self._ready_changed = threading.Condition()

    def _load(self) -> None:
        try:
            from llguidance import LLExecutor

            hf = self._auto_tokenizer.from_pretrained(self._model_dir, local_files_only=True)
            eos = self._eos_token_ids or None
            self._tokenizer = self._from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=eos)
            self._executor = LLExecutor()
        except BaseException as exc:  # reported when a structured request needs it
            self._error = exc
        finally:
            self._loaded.set()

    def prepare_for(self, req_id: int, grammar: str) -> None:
        """Build ``grammar`` (``prepare``) and, once it is built, report ``req_id`` ready
        (``take_ready``), however the build ended: a failed build fails the request when it
        first samples."""

        def built(_: Future[Any]) -> None:
            with self._ready_changed:
                self._ready.append(req_id)
                self._ready_changed.notify_all()

        self.prepare(grammar).add_done_callback(built)

    def take_ready(self, wait_s: float = 0.0) -> list[int]:
        """The requests whose grammars were built since the last call; with ``wait_s``, wait up
        to that long for one if there is none yet."""
        with self._ready_changed:
            if not self._ready and wait_s > 0:
                self._ready_changed.wait(wait_s)
            ready, self._ready = self._ready, []
            return ready

    def prepare(self, grammar: str) -> Future[Any]:
        """Start building ``grammar``'s matcher on the grammar thread, if not built or under way."""
        with self._templates_lock:
            future = self._templates.get(grammar)
            if future is None:
                future = self._pool.submit(self._build, grammar)
                self._templates[grammar] = future
                if len(self._templates) > _TEMPLATES_KEPT:
                    self._templates.popitem(last=False)
            else:
                self._templates.move_to_end(grammar)
            return future

    def _build(self, grammar: str) -> Any:
        from llguidance import LLMatcher, LLParserLimits

        self._loaded.wait()
        if self._error is not None:
            raise RuntimeError(f"structured outputs are unavailable: {self._error}")
        limits = LLParserLimits(**GRAMMAR_LIMITS)
        matcher = LLMatcher(self._tokenizer, grammar, log_level=1, limits=limits)
        if not matcher.is_error():
            # The first mask builds the lexer's start: part of the build, not of a step.
            matcher.compute_bitmask()
        return matcher

    def new_matcher(self, grammar: str) -> Any:
        """A matcher at the start of ``grammar``: a copy of its built template (waiting for the
        build if ``prepare`` has not finished it)."""
        return self.prepare(grammar).result().deep_copy()

    def bitmask(self, rows: list[tuple[int, Any]]) -> tuple[torch.Tensor, dict[int, str]]:
        """[len(rows), ceil(V / 32)] int32: the allowed tokens of each listed row, in order, and
        the rows whose matcher is in error, with its reason (their mask allows only EOS, so the
        row still samples something; the request fails)."""
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
        failed = {}
        for row, (_, matcher) in enumerate(rows):
            if matcher.is_error():  # before this mask, or while computing it
                failed[row] = (matcher.get_error().strip().splitlines() or ["?"])[0][
                    :_MAX_REASON_CHARS
                ]
                bitmask[row] = 0
                for eos in self._eos_token_ids:
                    word = int(bitmask[row, eos // 32]) | (1 << (eos % 32))
                    bitmask[row, eos // 32] = word - (1 << 32) if word >= 1 << 31 else word
        return bitmask, failed

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
