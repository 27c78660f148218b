"""How the torch attention backend splits a mixed batch: decode chunks and prompt requests.

Runs in worker processes. Planning reads only the host copies of the metadata (query_start_loc_cpu,
seq_lens_cpu), so building the plan never waits on the device. A request with one query token
(a decode, or a one-token prompt) joins a decode chunk: decodes sorted by context length and cut
into chunks whose gathered K/V stays under a budget, each chunk padded only to its own longest
context. A request with more query tokens (a prompt chunk) is attended to on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class DecodeChunk:
    # [num_seqs] int64 on the device: rows of the batch and of the flat token stream.
    req_ids: torch.Tensor
    token_ids: torch.Tensor
    # Blocks gathered per request: enough for the chunk's longest context.
    num_blocks: int
    # [1, num_seqs, 1, num_blocks * block_size] bool, True where a key exists; None if all do.
    mask: torch.Tensor | None


@dataclass(frozen=True)
class PrefillRequest:
    req_id: int
    query_start: int
    query_end: int
    seq_len: int
    num_blocks: int


@dataclass(frozen=True)
class BatchPlan:
    decode_chunks: list[DecodeChunk]
    prefill_requests: list[PrefillRequest]

    @property
    def max_decode_chunk_blocks(self) -> int:
        """Most blocks one decode chunk gathers (for sizing a reusable buffer)."""
        return max((len(c.token_ids) * c.num_blocks for c in self.decode_chunks), default=0)


def plan_batch(
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    block_size: int,
    max_chunk_tokens: int,
    device: torch.device,
) -> BatchPlan:
    """Group decodes into chunks of at most ``max_chunk_tokens`` padded context tokens."""
    query_lens = np.diff(query_start_loc)
    decode_req_ids = np.flatnonzero(query_lens == 1)
    prefill_req_ids = np.flatnonzero(query_lens > 1)
    prefills = [
        PrefillRequest(
            req_id=int(i),
            query_start=int(query_start_loc[i]),
            query_end=int(query_start_loc[i + 1]),
            seq_len=int(seq_lens[i]),
            num_blocks=-(-int(seq_lens[i]) // block_size),
        )
        for i in prefill_req_ids
    ]
    return BatchPlan(
        decode_chunks=_chunk_decodes(
            decode_req_ids, query_start_loc, seq_lens, block_size, max_chunk_tokens, device
        ),
        prefill_requests=prefills,
    )


def _chunk_decodes(
    req_ids: np.ndarray,
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    block_size: int,
    max_chunk_tokens: int,
    device: torch.device,
) -> list[DecodeChunk]:
    # Longest first, so each chunk's padding is set by its own first member.
    req_ids = req_ids[np.argsort(-seq_lens[req_ids], kind="stable")]
    chunks = []
    start = 0
    while start < len(req_ids):
        num_blocks = -(-int(seq_lens[req_ids[start]]) // block_size)
        padded_len = num_blocks * block_size
        end = min(len(req_ids), start + max(1, max_chunk_tokens // padded_len))
        chunk_req_ids = req_ids[start:end]
        chunk_seq_lens = seq_lens[chunk_req_ids]
        mask = None
        if int(chunk_seq_lens.min()) < padded_len:
            present = np.arange(padded_len)[None, :] < chunk_seq_lens[:, None]
            mask = _to_device(present.reshape(1, len(chunk_req_ids), 1, padded_len), device)
        chunks.append(
            DecodeChunk(
                req_ids=_to_device(chunk_req_ids.astype(np.int64), device),
                token_ids=_to_device(query_start_loc[chunk_req_ids].astype(np.int64), device),
                num_blocks=num_blocks,
                mask=mask,
            )
        )
        start = end
    return chunks


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)
