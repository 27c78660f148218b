"""One step's model inputs, gathered from the persistent batch with a few vectorized numpy ops.

Runs in worker processes. The step's tokens form one flat stream, request after request in row
order (selective batching: every token-wise op runs on ``[num_tokens, hidden]``). Nothing here
loops over tokens in Python; per-request work is limited to what numpy does in C.

The arrays land in buffers that live as long as the runner (``StepInputBuffers``): on CUDA,
page-locked host buffers copied asynchronously into fixed device buffers (the addresses a CUDA
graph reads), and a device copy of the block table that only the rows the step's diff changed are
written into. On CPU the host buffers are the inputs and the table is the batch's own array.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from conveyor.worker.attention.backend import AttentionMetadata
from conveyor.worker.attention.metadata_builder import StepLayout, step_layout
from conveyor.worker.device_buffers import StagingBuffer, StepUploads
from conveyor.worker.input_batch import InputBatch


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    metadata: AttentionMetadata
    # [S] int64: flat-stream index of each sampling request's last token (logits rows).
    logits_indices: torch.Tensor
    # [S] batch rows that sample this step, aligned with logits_indices.
    sampling_rows: np.ndarray

    @property
    def num_tokens(self) -> int:
        return self.metadata.num_actual_tokens

    @property
    def decode_only(self) -> bool:
        """Every scheduled request runs one token: the step CUDA graphs are captured for."""
        return self.metadata.max_query_len == 1

    @property
    def every_token_samples(self) -> bool:
        """logits_indices is 0 .. T-1: the hidden states need no gather before the LM head."""
        return len(self.sampling_rows) == self.num_tokens


class DeviceBlockTable:
    """The batch's block table where attention reads it, kept up to date row by row.

    ``mirror`` (default: off the CPU) keeps a copy on the device into which only the rows the
    diff changed are written; without it the table is the batch's own array, shared.
    """

    def __init__(self, batch: InputBatch, device: torch.device, mirror: bool | None = None) -> None:
        self.device = device
        self.mirror = device.type != "cpu" if mirror is None else mirror
        self._host_table = batch.block_table
        shape = batch.block_table.shape
        self._scheduled_rows = StagingBuffer(shape[0], torch.int64, device)
        if not self.mirror:
            # Always current, never copied.
            self.table = torch.from_numpy(batch.block_table)
            return
        self.table = torch.zeros(shape, dtype=torch.int32, device=device)
        self._staged = torch.zeros(shape, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._changed_rows = StagingBuffer(shape[0], torch.int64, device)

    def apply_changes(self, changed_rows: np.ndarray) -> None:
        """Copy the rows the diff changed (``InputBatch.take_changed_block_rows``) over."""
        if not self.mirror or len(changed_rows) == 0:
            return
        count = len(changed_rows)
        staged = self._staged[:count]
        staged.numpy()[:] = self._host_table[changed_rows]
        rows = self._changed_rows.stage(changed_rows)
        self.table.index_copy_(0, rows, staged.to(self.device, non_blocking=True))

    def rows_of(self, rows: np.ndarray) -> torch.Tensor:
        """[len(rows), max_blocks] int32: the table rows of a step's requests, in step order."""
        count = len(rows)
        # Rows are 0 .. count-1 in order (a LoRA step orders its rows by adapter: the ends
        # alone do not say it).
        if count and rows[0] == 0 and rows[-1] == count - 1 and (np.diff(rows) > 0).all():
            return self.table[:count]
        return self.table.index_select(0, self._scheduled_rows.stage(rows))


class StepInputBuffers:
    """The runner's input buffers, sized once for the largest step the scheduler can make."""

    def __init__(
        self,
        batch: InputBatch,
        max_num_tokens: int,
        device: torch.device,
        mirror_block_table: bool | None = None,
    ) -> None:
        max_num_reqs = batch.max_num_seqs
        self.input_ids = StagingBuffer(max_num_tokens, torch.int64, device)
        self.positions = StagingBuffer(max_num_tokens, torch.int64, device)
        self.slot_mapping = StagingBuffer(max_num_tokens, torch.int64, device)
        self.query_start_loc = StagingBuffer(max_num_reqs + 1, torch.int32, device)
        self.seq_lens = StagingBuffer(max_num_reqs, torch.int32, device)
        self.logits_indices = StagingBuffer(max_num_reqs, torch.int64, device)
        self.block_table = DeviceBlockTable(batch, device, mirror_block_table)
        # [max_num_seqs, max_blocks] int32: the rows a whole-forward decode graph reads (its
        # attention reads the table at a fixed address). Made now on CUDA, so the memory
        # profile counts it (elsewhere when first asked for: the CPU tests).
        self.graph_block_table: torch.Tensor | None = None
        if device.type == "cuda":
            self._graph_table()
        self._uploads = StepUploads(device)

    def prepare(
        self,
        batch: InputBatch,
        rows: np.ndarray,
        block_size: int,
        decode_graph_size: Callable[[int], int | None] | None = None,
    ) -> StepInputs:
        """Inputs for the scheduled ``rows`` (in that order) of ``batch``, on the device.

        ``decode_graph_size`` (the runner's, while it has whole-forward decode graphs): a
        decode-only step that one replays, of n requests padded to its size B, also gets its
        padding in the fixed buffers (rows n .. B-1: no context, slot -1; worker/cuda_graphs.py) and
        its block table rows in ``graph_block_table``. The metadata still covers the n.
        """
        # The host buffers are about to be rewritten: the previous step's copies must have run.
        self._uploads.wait()
        self.block_table.apply_changes(batch.take_changed_block_rows())
        num_scheduled = batch.num_scheduled_tokens[rows]
        num_computed = batch.num_computed_tokens[rows]
        layout = step_layout(num_scheduled, num_computed, batch.block_table, block_size, rows)
        token_rows = np.repeat(rows, num_scheduled)
        # A request samples once its known history is in the cache after this step; a prompt
        # chunk that stops short of the end produces no token (its logits would be thrown away).
        samples = num_computed + num_scheduled >= batch.num_tokens[rows]
        last_token = layout.query_start_loc[1:] - 1
        num_reqs = len(rows)
        graph_size = None
        if decode_graph_size is not None and layout.max_query_len == 1:
            graph_size = decode_graph_size(layout.num_tokens)
        block_table = self.block_table.rows_of(rows)
        if graph_size is None:
            slots, starts, seq_lens = layout.slot_mapping, layout.query_start_loc, layout.seq_lens
        else:
            slots, starts, seq_lens = _padded_decode(layout, graph_size)
            # The columns the step's contexts reach: attention reads no block past seq_len.
            columns = -(-layout.max_seq_len // block_size)
            self._graph_table()[:num_reqs, :columns].copy_(block_table[:, :columns])
        metadata = AttentionMetadata(
            num_actual_tokens=layout.num_tokens,
            slot_mapping=self.slot_mapping.stage(slots)[: layout.num_tokens],
            query_start_loc=self.query_start_loc.stage(starts)[: num_reqs + 1],
            seq_lens=self.seq_lens.stage(seq_lens)[:num_reqs],
            block_table=block_table,
            max_query_len=layout.max_query_len,
            max_seq_len=layout.max_seq_len,
            query_start_loc_cpu=layout.query_start_loc,
            seq_lens_cpu=layout.seq_lens,
        )
        inputs = StepInputs(
            input_ids=self.input_ids.stage(batch.token_ids[token_rows, layout.positions]),
            positions=self.positions.stage(layout.positions),
            metadata=metadata,
            logits_indices=self.logits_indices.stage(last_token[samples]),
            sampling_rows=rows[samples],
        )
        self._uploads.uploaded()
        return inputs

    def graph_metadata(self, size: int) -> AttentionMetadata:
        """A decode step of ``size`` padding requests on the fixed buffers, which a
        whole-forward decode graph of that size is captured on: its attention reads nothing and
        writes only zeros to its output, whatever the cache holds; at replay ``prepare`` has put
        the step's values where it reads."""
        self._uploads.wait()
        empty = StepLayout(
            query_start_loc=np.zeros(1, dtype=np.int32),
            positions=np.zeros(0, dtype=np.int64),
            slot_mapping=np.zeros(0, dtype=np.int64),
            seq_lens=np.zeros(0, dtype=np.int32),
            max_query_len=1,
            max_seq_len=0,
        )
        slots, starts, seq_lens = _padded_decode(empty, size)
        metadata = AttentionMetadata(
            num_actual_tokens=size,
            slot_mapping=self.slot_mapping.stage(slots),
            query_start_loc=self.query_start_loc.stage(starts),
            seq_lens=self.seq_lens.stage(seq_lens),
            block_table=self._graph_table()[:size],
            max_query_len=1,
            max_seq_len=0,
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
        )
        self._uploads.uploaded()
        return metadata

    def _graph_table(self) -> torch.Tensor:
        if self.graph_block_table is None:
            shape = self.block_table.table.shape
            self.graph_block_table = torch.zeros(
                shape, dtype=torch.int32, device=self.block_table.device
            )
        return self.graph_block_table


def _padded_decode(layout: StepLayout, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Slots, query starts and context lengths of a decode step padded to ``size`` requests:
    padding request i is row i's token with slot -1 (its K/V go nowhere) and a context of 0
    (no key is visible to it), so attention reads nothing for it and writes zeros to its row."""
    num_reqs = len(layout.seq_lens)
    pad = size - num_reqs
    slots = np.concatenate([layout.slot_mapping, np.full(pad, -1, dtype=np.int64)])
    end = int(layout.query_start_loc[-1])
    padding_starts = np.arange(end + 1, end + pad + 1, dtype=np.int32)
    starts = np.concatenate([layout.query_start_loc, padding_starts])
    seq_lens = np.concatenate([layout.seq_lens, np.zeros(pad, dtype=np.int32)])
    return slots, starts, seq_lens
