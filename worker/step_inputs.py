"""One step's model inputs, gathered from the persistent batch with a few vectorized numpy ops.

Runs in worker processes. The step's tokens form one flat stream, request after request in row
order (selective batching: every token-wise op runs on ``[num_tokens, hidden]``). Nothing here
loops over tokens in Python; per-request work is limited to what numpy does in C.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker.attention.backend import AttentionMetadata
from worker.attention.metadata_builder import build_attention_metadata
from worker.input_batch import InputBatch


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    metadata: AttentionMetadata
    # [S] int64: flat-stream index of each sampling request's last token (logits rows).
    logits_indices: torch.Tensor
    # [S] batch rows that sample this step, aligned with logits_indices.
    sampling_rows: np.ndarray


def prepare_step_inputs(
    batch: InputBatch, rows: np.ndarray, block_size: int, device: torch.device
) -> StepInputs:
    """Inputs for the scheduled ``rows`` (in that order) of ``batch``."""
    num_scheduled = batch.num_scheduled_tokens[rows]
    num_computed = batch.num_computed_tokens[rows]
    # Only the columns some scheduled request uses: the table is sized for max_model_len.
    num_columns = max(int(batch.num_blocks[rows].max()), 1)
    metadata, positions = build_attention_metadata(
        num_scheduled, num_computed, batch.block_table[rows, :num_columns], block_size, device
    )
    token_rows = np.repeat(rows, num_scheduled)
    input_ids = batch.token_ids[token_rows, positions].astype(np.int64)
    # A request samples once its known history is in the cache after this step; a prompt chunk
    # that stops short of the end produces no token (its logits would be thrown away).
    samples = num_computed + num_scheduled >= batch.num_tokens[rows]
    last_token = np.cumsum(num_scheduled) - 1
    return StepInputs(
        input_ids=_to_device(input_ids, device),
        positions=_to_device(positions.astype(np.int64, copy=False), device),
        metadata=metadata,
        logits_indices=_to_device(last_token[samples].astype(np.int64), device),
        sampling_rows=rows[samples],
    )


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor if device.type == "cpu" else tensor.to(device)
