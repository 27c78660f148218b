"""Build one step's AttentionMetadata and token positions from per-request counters.

Runs in worker processes; the model runner calls it once per step. All arithmetic is vectorised
numpy over the flat token stream, so its cost does not grow with a Python loop per token.
``step_layout`` is the host arithmetic alone: the runner stages its arrays into buffers that live
across steps (worker/step_inputs.py); ``build_attention_metadata`` wraps it with fresh tensors for
callers that run one step on their own (memory profiling, tests, benchmarks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from conveyor.worker.attention.backend import AttentionMetadata
from conveyor.worker.device_buffers import array_to_device


@dataclass
class StepLayout:
    """Where each of a step's tokens sits, on the host."""

    # [num_reqs + 1] int32: cumulative query lengths (cu_seqlens_q).
    query_start_loc: np.ndarray
    # [num_tokens] int64: each token's position in its request.
    positions: np.ndarray
    # [num_tokens] int64: block_id * block_size + offset of each token's K/V.
    slot_mapping: np.ndarray
    # [num_reqs] int32: context length after this step.
    seq_lens: np.ndarray
    max_query_len: int
    max_seq_len: int

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])


def step_layout(
    num_scheduled_tokens: np.ndarray,
    num_computed_tokens: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
    table_rows: np.ndarray | None = None,
) -> StepLayout:
    """Positions and slots of requests laid out one after another in the flat token stream.

    ``num_scheduled_tokens[i]`` tokens of request ``i`` run this step, following the
    ``num_computed_tokens[i]`` already in its KV cache. Its blocks are row ``table_rows[i]`` of
    ``block_table`` (row ``i`` without ``table_rows``), so the runner passes its whole persistent
    table instead of copying the scheduled rows out.
    """
    num_reqs = len(num_scheduled_tokens)
    scheduled = np.asarray(num_scheduled_tokens, dtype=np.int64)
    computed = np.asarray(num_computed_tokens, dtype=np.int64)
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
    np.cumsum(scheduled, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])

    req_of_token = np.repeat(np.arange(num_reqs), scheduled)
    offset_in_query = np.arange(num_tokens) - query_start_loc[req_of_token]
    positions = computed[req_of_token] + offset_in_query
    rows_of_token = req_of_token if table_rows is None else table_rows[req_of_token]
    slot_mapping = _slots(positions, rows_of_token, block_table, block_size)
    seq_lens = (computed + scheduled).astype(np.int32)
    return StepLayout(
        query_start_loc=query_start_loc,
        positions=positions,
        slot_mapping=slot_mapping,
        seq_lens=seq_lens,
        max_query_len=int(scheduled.max()) if num_reqs else 0,
        max_seq_len=int(seq_lens.max()) if num_reqs else 0,
    )


def build_attention_metadata(
    num_scheduled_tokens: np.ndarray,
    num_computed_tokens: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
    device: torch.device,
) -> tuple[AttentionMetadata, np.ndarray]:
    """Metadata for requests laid out one after another in the flat token stream.

    ``block_table[i]`` lists request ``i``'s blocks in order. Returns the metadata and each
    token's position (int64).
    """
    device = torch.device(device)
    layout = step_layout(num_scheduled_tokens, num_computed_tokens, block_table, block_size)
    num_reqs = len(layout.seq_lens)
    metadata = AttentionMetadata(
        num_actual_tokens=layout.num_tokens,
        slot_mapping=array_to_device(layout.slot_mapping, device),
        query_start_loc=array_to_device(layout.query_start_loc, device),
        seq_lens=array_to_device(layout.seq_lens, device),
        # A copy, so the caller may keep editing its table while this step runs.
        block_table=array_to_device(np.array(block_table[:num_reqs], dtype=np.int32), device),
        max_query_len=layout.max_query_len,
        max_seq_len=layout.max_seq_len,
        query_start_loc_cpu=layout.query_start_loc,
        seq_lens_cpu=layout.seq_lens,
    )
    return metadata, layout.positions


def _slots(
    positions: np.ndarray, table_rows: np.ndarray, block_table: np.ndarray, block_size: int
) -> np.ndarray:
    block_index = positions // block_size
    if len(positions) and int(block_index.max()) >= block_table.shape[1]:
        raise ValueError(
            f"a token at position {int(positions.max())} needs block index "
            f"{int(block_index.max())}, but the block table has {block_table.shape[1]} columns"
        )
    block_ids = block_table[table_rows, block_index].astype(np.int64)
    return block_ids * block_size + positions % block_size
