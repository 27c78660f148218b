"""Build one step's AttentionMetadata and token positions from per-request counters.

Runs in worker processes; the model runner calls it once per step. All arithmetic is vectorised
numpy over the flat token stream, so its cost does not grow with a Python loop per token.
"""

from __future__ import annotations

import numpy as np
import torch

from worker.attention.backend import AttentionMetadata


def build_attention_metadata(
    num_scheduled_tokens: np.ndarray,
    num_computed_tokens: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
    device: torch.device,
) -> tuple[AttentionMetadata, np.ndarray]:
    """Metadata for requests laid out one after another in the flat token stream.

    ``num_scheduled_tokens[i]`` tokens of request ``i`` run this step, following the
    ``num_computed_tokens[i]`` already in its KV cache; ``block_table[i]`` lists its blocks in
    order. Returns the metadata and each token's position (int64).
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
    slot_mapping = _slots(positions, req_of_token, block_table, block_size)
    seq_lens = (computed + scheduled).astype(np.int32)

    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens,
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        query_start_loc=torch.from_numpy(query_start_loc).to(device),
        seq_lens=torch.from_numpy(seq_lens).to(device),
        # A copy, so the runner may keep editing its persistent table while this step runs.
        block_table=torch.tensor(block_table[:num_reqs], dtype=torch.int32, device=device),
        max_query_len=int(scheduled.max()) if num_reqs else 0,
        max_seq_len=int(seq_lens.max()) if num_reqs else 0,
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )
    return metadata, positions


def _slots(
    positions: np.ndarray, req_of_token: np.ndarray, block_table: np.ndarray, block_size: int
) -> np.ndarray:
    block_index = positions // block_size
    if len(positions) and int(block_index.max()) >= block_table.shape[1]:
        raise ValueError(
            f"a token at position {int(positions.max())} needs block index "
            f"{int(block_index.max())}, but the block table has {block_table.shape[1]} columns"
        )
    block_ids = block_table[req_of_token, block_index].astype(np.int64)
    return block_ids * block_size + positions % block_size
