"""Draft proposers: who guesses a request's next tokens, behind one small interface.

Runs in worker processes. A proposer is asked right after a step's tokens are appended to the
persistent batch, for the rows that sampled, and answers each with up to k draft tokens (fewer or
none when it has no good guess). The engine core schedules them in the request's next step. A
proposer that runs a model (a draft model, EAGLE/MTP heads reading the target's hidden states)
fits the same call: it lives in the worker beside the target and gets the batch and the rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from conveyor.protocol.speculative import SpeculativeConfig
from conveyor.worker.input_batch import InputBatch
from conveyor.worker.spec_decode.ngram import propose_ngram


class Proposer(Protocol):
    def propose(self, batch: InputBatch, rows: list[int]) -> list[list[int]]:
        """Draft tokens for each of ``rows`` (batch rows whose tokens are all known)."""
        ...


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest suffix's earlier occurrence."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.max_model_len = max_model_len

    def propose(self, batch: InputBatch, rows: list[int]) -> list[list[int]]:
        drafts = []
        for row in rows:
            num_tokens = int(batch.num_tokens[row])
            # Drafts are written after the known tokens: never past the row's width.
            k = min(self.k, self.max_model_len - num_tokens - 1)
            if k <= 0:
                drafts.append([])
                continue
            tokens = batch.token_ids[row, :num_tokens]
            drafts.append(propose_ngram(tokens, k, self.min_n, self.max_n))
        return drafts


def make_proposer(
    config: SpeculativeConfig, max_model_len: int, load_draft: Callable[[], Proposer] | None = None
) -> Proposer:
    """The method's proposer; ``load_draft`` builds a draft model's (it needs the runner's
    device, dtypes, attention backend and tensor-parallel rank)."""
    if config.method == "ngram":
        return NgramProposer(config, max_model_len)
    if config.method == "draft_model" and load_draft is not None:
        return load_draft()
    raise ValueError(f"no proposer {config.method!r}")
