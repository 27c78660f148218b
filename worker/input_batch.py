"""The persistent batch: the worker's mirror of every request it is running, as numpy rows.

Runs in worker processes. The engine core sends a diff each step (``SchedulerOutput``): new
requests once in full, known requests as a few counters and new block ids. ``InputBatch.apply``
folds the diff into fixed-size arrays in place, so a decode step of hundreds of requests costs a
handful of numpy writes rather than rebuilding every request's history. The worker appends the
tokens it sampled itself (``append_sampled``); they never travel back from the engine.

Rows are dense: rows ``0 .. num_reqs-1`` hold running requests, and a request that leaves is
replaced by the last row (condensing), so every per-step gather is a slice or a fancy index.
A preempted request loses its row but keeps its ``RequestState`` (its seeded generator must go
on where it stopped when the request resumes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from conveyor.protocol import SamplingParams, SchedulerOutput


@dataclass
class RequestState:
    """What the worker keeps about a request for its whole life, preempted or not."""

    req_id: int
    sampling_params: SamplingParams
    num_prompt_tokens: int
    # A torch.Generator for seeded requests (made by the runner), else None.
    generator: Any = None
    # The grammar matcher of a structured-output request (made when it first samples).
    matcher: Any = None
    # Prompt logprobs recorded so far, (token ids, logprobs, rank) per prompt position from the
    # first (worker/prompt_logprobs.py), until they leave with the first sampled token.
    prompt_logprob_rows: list[tuple[list[int], list[float], int]] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # The engine's id of the request's LoRA adapter (0: the base model).
    lora_id: int = 0
    # A draft model's progress (worker/spec_decode/draft_model.py): positions whose draft KV
    # holds the request's real tokens, the drafts it made last, their distributions for random
    # rows, and the prefix keys of its blocks full of them. Reset whenever the request gets a
    # row: a resumed request's blocks are new.
    draft_num_computed: int = 0
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: Any = None
    draft_block_keys: list[int] = field(default_factory=list)
    # The engine core's back-off, mirrored: draft steps in a row with nothing accepted, and
    # steps left without drafts (a draft model's forwards are skipped meanwhile).
    draft_misses: int = 0
    draft_paused: int = 0


class InputBatch:
    """Token ids, counters and block tables of running requests, one row per request."""

    def __init__(
        self,
        max_num_seqs: int,
        max_model_len: int,
        max_blocks_per_req: int,
        make_generator: Callable[[int], Any] | None = None,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_blocks_per_req = max_blocks_per_req
        self._make_generator = make_generator
        self.token_ids = np.zeros((max_num_seqs, max_model_len), dtype=np.int32)
        # Known tokens: prompt + outputs so far (the worker appends what it samples).
        self.num_tokens = np.zeros(max_num_seqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_seqs, dtype=np.int32)
        # Tokens already in the KV cache before this step, as the engine scheduled it.
        self.num_computed_tokens = np.zeros(max_num_seqs, dtype=np.int32)
        self.num_scheduled_tokens = np.zeros(max_num_seqs, dtype=np.int32)
        # Block 0 is the KV manager's null block, so 0 is a safe pad for unused entries.
        self.block_table = np.zeros((max_num_seqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int32)
        # Rows whose block table changed since ``take_changed_block_rows``: the runner mirrors
        # only those into its device copy of the table.
        self._block_rows_changed = np.zeros(max_num_seqs, dtype=bool)
        self.num_reqs = 0
        self.req_ids: list[int] = []
        self.row_states: list[RequestState] = []
        self.row_of: dict[int, int] = {}
        # Every mirrored request, including preempted ones without a row.
        self.states: dict[int, RequestState] = {}

    # ------------------------------------------------------------------ applying a diff

    def apply(self, scheduler_output: SchedulerOutput) -> None:
        """Fold one step's diff into the rows, in place."""
        leaving = set(scheduler_output.finished_req_ids)
        leaving.update(scheduler_output.preempted_req_ids)
        self._remove_rows([self.row_of[r] for r in leaving if r in self.row_of])
        for req_id in scheduler_output.finished_req_ids:
            self.states.pop(req_id, None)
        self.num_scheduled_tokens[: self.num_reqs] = 0
        for new in scheduler_output.scheduled_new_reqs:
            state = self.states.get(new.req_id)
            if state is None:
                state = self._new_state(new.req_id, new.sampling_params, len(new.prompt_token_ids))
                state.lora_id = new.lora_id
            elif new.req_id in self.row_of:
                self._remove_rows([self.row_of[new.req_id]])
            row = self._add_row(state, new.prompt_token_ids, new.block_ids)
            self.num_computed_tokens[row] = new.num_computed_tokens
            self.num_scheduled_tokens[row] = new.num_scheduled_tokens
        self._apply_cached(scheduler_output)

    def _apply_cached(self, scheduler_output: SchedulerOutput) -> None:
        cached = scheduler_output.scheduled_cached_reqs
        if not cached.req_ids:
            return
        resumed = cached.resumed_token_ids
        for req_id, block_ids in zip(cached.req_ids, cached.new_block_ids):
            if req_id in resumed:
                if req_id in self.row_of:
                    self._remove_rows([self.row_of[req_id]])
                self._add_row(self.states[req_id], resumed[req_id], block_ids)
        row_of = self.row_of
        rows = np.fromiter((row_of[r] for r in cached.req_ids), np.int64, len(cached.req_ids))
        # Most decode steps add no block to most requests: only those with new ids are touched.
        for i, block_ids in enumerate(cached.new_block_ids):
            if block_ids and cached.req_ids[i] not in resumed:
                row = rows[i]
                start = self.num_blocks[row]
                end = start + len(block_ids)
                self.block_table[row, start:end] = block_ids
                self.num_blocks[row] = end
                self._block_rows_changed[row] = True
        self.num_computed_tokens[rows] = cached.num_computed_tokens
        self.num_scheduled_tokens[rows] = cached.num_scheduled_tokens

    def _new_state(
        self, req_id: int, sampling_params: SamplingParams, num_prompt_tokens: int
    ) -> RequestState:
        generator = None
        if sampling_params.seed is not None and self._make_generator is not None:
            generator = self._make_generator(sampling_params.seed)
        state = RequestState(req_id, sampling_params, num_prompt_tokens, generator)
        self.states[req_id] = state
        return state

    def _add_row(self, state: RequestState, token_ids: list[int], block_ids: list[int]) -> int:
        if self.num_reqs >= self.max_num_seqs:
            raise RuntimeError(f"more than max_num_seqs={self.max_num_seqs} requests scheduled")
        if len(token_ids) > self.max_model_len or len(block_ids) > self.max_blocks_per_req:
            raise RuntimeError(f"request {state.req_id} does not fit max_model_len")
        row = self.num_reqs
        self.num_reqs += 1
        state.draft_num_computed = 0
        state.draft_token_ids = []
        state.draft_probs = None
        state.draft_block_keys = []
        self.req_ids.append(state.req_id)
        self.row_states.append(state)
        self.row_of[state.req_id] = row
        self.token_ids[row, : len(token_ids)] = token_ids
        self.num_tokens[row] = len(token_ids)
        self.num_prompt_tokens[row] = state.num_prompt_tokens
        self.block_table[row, : len(block_ids)] = block_ids
        self.block_table[row, len(block_ids) :] = 0
        self.num_blocks[row] = len(block_ids)
        self._block_rows_changed[row] = True
        self.num_scheduled_tokens[row] = 0
        return row

    def _remove_rows(self, rows: list[int]) -> None:
        """Drop rows and fill the holes with rows from the tail, keeping rows dense."""
        if not rows:
            return
        removed = set(rows)
        new_num_reqs = self.num_reqs - len(removed)
        holes = sorted(r for r in removed if r < new_num_reqs)
        movers = [r for r in range(new_num_reqs, self.num_reqs) if r not in removed]
        for row in removed:
            del self.row_of[self.req_ids[row]]
        if holes:
            dst, src = np.array(holes), np.array(movers)
            width = int(self.num_tokens[src].max())
            self.token_ids[dst, :width] = self.token_ids[src, :width]
            for array in (
                self.num_tokens,
                self.num_prompt_tokens,
                self.num_computed_tokens,
                self.num_scheduled_tokens,
                self.num_blocks,
                self.block_table,
            ):
                array[dst] = array[src]
            self._block_rows_changed[dst] = True
            for hole, mover in zip(holes, movers):
                self.req_ids[hole] = self.req_ids[mover]
                self.row_states[hole] = self.row_states[mover]
                self.row_of[self.req_ids[hole]] = hole
        del self.req_ids[new_num_reqs:]
        del self.row_states[new_num_reqs:]
        self.num_reqs = new_num_reqs

    # ------------------------------------------------------------------ after sampling

    def append_sampled(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Append each row's freshly sampled token to its history (vectorized)."""
        if len(rows) == 0:
            return
        positions = self.num_tokens[rows]
        if int(positions.max()) >= self.max_model_len:
            raise RuntimeError("a request grew past max_model_len")
        self.token_ids[rows, positions] = token_ids
        self.num_tokens[rows] = positions + 1

    # ------------------------------------------------------------------ views for the runner

    def output_token_ids(self, row: int) -> np.ndarray:
        return self.token_ids[row, self.num_prompt_tokens[row] : self.num_tokens[row]]

    def prompt_token_ids(self, row: int) -> np.ndarray:
        return self.token_ids[row, : self.num_prompt_tokens[row]]

    def take_changed_block_rows(self) -> np.ndarray:
        """Rows whose block table changed since the last call (new, moved or given blocks)."""
        rows = np.flatnonzero(self._block_rows_changed[: self.num_reqs])
        self._block_rows_changed[:] = False
        return rows

    def scheduled_rows(self) -> np.ndarray:
        """Rows with tokens this step, in row order: the order of the step's flat stream."""
        return np.flatnonzero(self.num_scheduled_tokens[: self.num_reqs])

    def sampling_rows(self, rows: np.ndarray) -> np.ndarray:
        """Of ``rows``, those whose known history is complete after this step: they sample."""
        done = self.num_computed_tokens[rows] + self.num_scheduled_tokens[rows]
        return rows[done >= self.num_tokens[rows]]
