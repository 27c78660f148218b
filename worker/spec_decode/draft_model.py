"""The draft-model proposer: a smaller model with the target's vocabulary guesses k tokens.

Runs in worker processes, beside the target, sharded the same way under tensor parallelism.

**Its KV cache** shares the target's block tables: every block id the engine core hands out has
room in the target's cache and in the draft's (the draft's own tensors, its own layer count and
head shapes), so the KV budget is split per block, target bytes + draft bytes, and the engine's
block accounting covers both with no second table. A slot the target writes at position p holds
the draft's KV of the same token at p once the draft has caught up.

The draft does not run in the target's steps. When asked to propose for a request, it first
catches up: it runs over the request's tokens from the first position whose draft KV it cannot
vouch for (``RequestState.draft_num_computed``) to its latest token, whose logits give draft 1;
then k - 1 single-token steps, each one batched forward over every proposing request, write the
drafts' own KV at the positions after it. Next time, the drafts the target accepted are
already in the draft's cache (they are the tokens it ran on); the first rejected position and
what follows are run again. What it lacks it recomputes:

* a request's row is new (arrival, or resumed after preemption): ``draft_num_computed`` is 0,
  and its prefix-cache hits are trusted only as far as the draft's own record of its blocks
  goes (worker/spec_decode/draft_cache.py);
* steps without drafts (the off-switch, a back-off) leave the draft behind; it catches up at
  its next proposal, in chunks no larger than the engine's token budget.

The positions after the request's latest token (where the draft writes its own drafts' KV) are
slots the engine reserved for it (``SpeculativeConfig.num_lookahead_tokens``); a row with fewer
slots gets fewer drafts. Those slots are never in the prefix cache: it registers only blocks
full of known tokens.

Greedy requests take the draft's argmax; random requests sample it from the draft's distribution
``q`` at the request's temperature (from the request's own generator when seeded), and ``q`` is
kept for the verifier's ``min(1, p/q)`` test (worker/spec_decode/rejection_sampler.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from conveyor.protocol.speculative import SpeculativeConfig
from conveyor.worker.attention.backend import AttentionBackend, AttentionMetadata
from conveyor.worker.attention.metadata_builder import step_layout
from conveyor.worker.device_buffers import array_to_device
from conveyor.worker.input_batch import InputBatch
from conveyor.worker.kv_cache import attach_kv_caches, layers_bytes_per_block
from conveyor.worker.loader import load_model
from conveyor.worker.sampler import race
from conveyor.worker.sampling_metadata import _effective_temperature
from conveyor.worker.spec_decode.draft_cache import DraftBlockKeys


class DraftModelProposer:
    """A draft model, its KV cache, and k draft steps per proposal."""

    def __init__(
        self,
        config: SpeculativeConfig,
        *,
        max_model_len: int,
        max_num_tokens: int,
        block_size: int,
        vocab_size: int,
        device: torch.device,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        make_backend: Callable[[bool], AttentionBackend],
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        assert config.model is not None
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.max_num_tokens = max_num_tokens
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.kv_dtype = kv_dtype
        self.model = load_model(config.model, dtype, device, tp_rank, tp_size, config.quantization)
        if self.model.kv_sliding_window() is not None:
            # The draft catches up over a request's whole history, which a sliding-window
            # cache drops as it goes.
            raise ValueError(f"draft model {config.model}: sliding-window attention is refused")
        self.attention_layers = self.model.attention_layers()
        needs_sinks = any(layer.sinks is not None for layer in self.attention_layers)
        self.backend = make_backend(needs_sinks)

    # ------------------------------------------------------------------ KV cache

    def bytes_per_block(self) -> int:
        return layers_bytes_per_block(self.attention_layers, self.block_size, self.kv_dtype)

    def initialize_cache(self, num_blocks: int) -> None:
        attach_kv_caches(
            self.attention_layers, num_blocks, self.block_size, self.kv_dtype, self.device,
            self.backend,
        )  # fmt: skip
        self.block_keys = DraftBlockKeys(num_blocks, self.block_size)

    def release(self) -> None:
        for layer in self.attention_layers:
            layer.kv_cache = None
        self.attention_layers = []
        self.model = None

    # ------------------------------------------------------------------ proposing

    def propose(self, batch: InputBatch, rows: list[int]) -> list[list[int]]:
        num_drafts = [self._room(batch, row) for row in rows]
        proposing = [row for row, k in zip(rows, num_drafts) if k > 0]
        drafts: dict[int, list[int]] = {row: [] for row in rows}
        if not proposing:
            return [[] for _ in rows]
        room = dict(zip(rows, num_drafts))
        probs: dict[int, list[torch.Tensor]] = {row: [] for row in proposing}
        starts = {row: self._first_unknown(batch, row) for row in proposing}
        for row in proposing:
            # Every block written below loses its key first (it holds neither what it held
            # nor, until the row's blocks are keyed again after, a known prefix).
            last = int(batch.num_tokens[row]) + room[row] - 2
            self.block_keys.forget(batch, row, starts[row], last)
        logits = self._catch_up(batch, proposing, starts)
        active = proposing
        for j in range(self.k):
            tokens = self._sample(batch, active, logits, probs)
            for row, token in zip(active, tokens):
                drafts[row].append(token)
            active_next = [row for row in active if room[row] > j + 1]
            if not active_next:
                break
            last = [drafts[row][-1] for row in active_next]
            logits = self._decode(batch, active_next, last, j + 1)
            active = active_next
        for row in proposing:
            state = batch.row_states[row]
            state.draft_token_ids = drafts[row]
            state.draft_num_computed = int(batch.num_tokens[row])
            state.draft_probs = torch.stack(probs[row]) if probs[row] else None
            self.block_keys.record(batch, row)
        return [drafts[row] for row in rows]

    def _room(self, batch: InputBatch, row: int) -> int:
        """Drafts the row may get: k, fewer near the context's end or its last reserved slot
        (the draft writes its drafts' KV at positions num_tokens .. num_tokens + k - 2, its
        latest token's at num_tokens - 1)."""
        num_tokens = int(batch.num_tokens[row])
        capacity = int(batch.num_blocks[row]) * self.block_size
        return max(0, min(self.k, self.max_model_len - num_tokens - 1, capacity - num_tokens + 1))

    def _first_unknown(self, batch: InputBatch, row: int) -> int:
        """The first position whose draft KV must be computed: past what it holds of real tokens
        and of its own last drafts that turned out right; never past the latest token (its
        logits are draft 1's)."""
        state = batch.row_states[row]
        num_tokens = int(batch.num_tokens[row])
        start = state.draft_num_computed
        if start == 0:
            return min(self.block_keys.trusted_prefix(batch, row), num_tokens - 1)
        if state.draft_token_ids:
            # The last drafts' KV sits at start .. start + k - 2 (the k-th was never run).
            written = state.draft_token_ids[:-1][: max(0, num_tokens - start)]
            actual = batch.token_ids[row, start : start + len(written)]
            same = np.asarray(written) == actual
            start += len(written) if same.all() else int(np.argmin(same))
        return min(start, num_tokens - 1)

    def _catch_up(self, batch: InputBatch, rows: list[int], starts: dict[int, int]) -> torch.Tensor:
        """Run each row from ``starts`` (its first unknown position) to its latest token, in
        forwards of at most the engine's token budget; the latest tokens' logits, in ``rows``
        order."""
        starts = dict(starts)
        ends = {row: int(batch.num_tokens[row]) for row in rows}
        last_logits: dict[int, torch.Tensor] = {}
        while len(last_logits) < len(rows):
            budget, part = self.max_num_tokens, []
            for row in rows:
                if row in last_logits or budget <= 0:
                    continue
                count = min(ends[row] - starts[row], budget)
                part.append((row, starts[row], count))
                budget -= count
            part_rows = np.array([row for row, _, _ in part])
            computed = np.array([start for _, start, _ in part])
            scheduled = np.array([count for _, _, count in part])
            token_ids = np.concatenate(
                [batch.token_ids[row, start : start + n] for row, start, n in part]
            )
            done = [i for i, (row, start, n) in enumerate(part) if start + n == ends[row]]
            logits = self._forward(batch, part_rows, computed, scheduled, token_ids, done)
            for i, row_logits in zip(done, logits):
                last_logits[part[i][0]] = row_logits
            for row, start, n in part:
                starts[row] = start + n
        return torch.stack([last_logits[row] for row in rows])

    def _decode(
        self, batch: InputBatch, rows: list[int], token_ids: list[int], step: int
    ) -> torch.Tensor:
        """One token per row: draft ``step`` at position num_tokens - 1 + step."""
        row_array = np.array(rows)
        computed = batch.num_tokens[row_array].astype(np.int64) - 1 + step
        ones = np.ones(len(rows), dtype=np.int64)
        everyone = list(range(len(rows)))
        return self._forward(batch, row_array, computed, ones, np.array(token_ids), everyone)

    def _forward(
        self,
        batch: InputBatch,
        rows: np.ndarray,
        computed: np.ndarray,
        scheduled: np.ndarray,
        token_ids: np.ndarray,
        sampled: list[int],
    ) -> torch.Tensor:
        """The draft over one flat stream (``rows``' tokens after their ``computed`` ones); the
        logits at the last token of each of the rows numbered ``sampled``."""
        layout = step_layout(scheduled, computed, batch.block_table, self.block_size, rows)
        device = self.device
        metadata = AttentionMetadata(
            num_actual_tokens=layout.num_tokens,
            slot_mapping=array_to_device(layout.slot_mapping, device),
            query_start_loc=array_to_device(layout.query_start_loc, device),
            seq_lens=array_to_device(layout.seq_lens, device),
            block_table=array_to_device(np.ascontiguousarray(batch.block_table[rows]), device),
            max_query_len=layout.max_query_len,
            max_seq_len=layout.max_seq_len,
            query_start_loc_cpu=layout.query_start_loc,
            seq_lens_cpu=layout.seq_lens,
        )
        last = layout.query_start_loc[1:] - 1
        index = array_to_device(last[sampled].astype(np.int64), device)
        hidden = self.model.forward(
            array_to_device(token_ids.astype(np.int64), device),
            array_to_device(layout.positions, device),
            metadata,
            index,
        )
        return self.model.compute_logits(hidden)[:, : self.vocab_size]

    @staticmethod
    def _sample(
        batch: InputBatch,
        rows: list[int],
        logits: torch.Tensor,
        probs: dict[int, list[torch.Tensor]],
    ) -> list[int]:
        """Greedy rows' argmax; random rows' draws from q = softmax(logits / T), kept in
        ``probs`` for the verifier."""
        tokens = logits.argmax(dim=-1)
        temperatures = [
            _effective_temperature(batch.row_states[row].sampling_params) for row in rows
        ]
        random = [i for i, t in enumerate(temperatures) if t > 0.0]
        if random:
            index = torch.tensor(random, device=logits.device)
            scale = torch.tensor([temperatures[i] for i in random], device=logits.device)
            q = (logits.index_select(0, index) / scale.unsqueeze(1)).softmax(dim=-1)
            generators = {
                i: batch.row_states[rows[r]].generator
                for i, r in enumerate(random)
                if batch.row_states[rows[r]].generator is not None
            }
            drawn = race(q.clone(), generators)
            tokens = tokens.index_copy(0, index, drawn)
            for i, r in enumerate(random):
                probs[rows[r]].append(q[i])
        return tokens.tolist()
