"""How the torch attention backend splits a mixed batch: kernel items, decode chunks, prompts.

Runs in worker processes. Planning reads only the host copies of the metadata (query_start_loc_cpu,
seq_lens_cpu), so building the plan never waits on the device. Where the compiled CPU kernel runs,
every request (decodes and prompt chunks of any length alike) becomes kernel work items: tiles of
consecutive query tokens, longest context first so the kernel's threads finish together.
Otherwise a request with one query token (a decode, or a one-token prompt) joins a decode chunk:
decodes sorted by context length and cut into chunks whose gathered K/V stays under a budget, each
chunk padded only to its own longest context. A request with more query tokens (a prompt chunk)
is attended to on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from conveyor.worker.device_buffers import array_to_device


@dataclass(frozen=True)
class DecodeChunk:
    # [num_seqs] int64 on the device: rows of the batch and of the flat token stream.
    req_ids: torch.Tensor
    token_ids: torch.Tensor
    # Blocks gathered per request: enough for the chunk's longest context.
    num_blocks: int
    # [1, num_seqs, 1, num_blocks * block_size] bool, True where a key exists; None if all do.
    mask: torch.Tensor | None
    # Host copy of the members' context lengths and the cache's block size, for windowed masks.
    seq_lens: np.ndarray | None = None
    block_size: int = 0
    # Windowed masks, made on first use by a layer with that window, shared by the step's others.
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict, compare=False)

    def window_mask(self, window: int) -> torch.Tensor:
        """Like ``mask``, but hiding also every key more than ``window - 1`` behind the query."""
        mask = self._window_masks.get(window)
        if mask is None:
            if self.seq_lens is None:
                raise ValueError("a decode chunk planned without seq_lens has no window masks")
            seq_lens = self.seq_lens[:, None]
            positions = np.arange(self.num_blocks * self.block_size)[None, :]
            visible = (positions < seq_lens) & (positions >= seq_lens - window)
            device = self.req_ids.device
            mask = _to_device(visible.reshape(1, len(seq_lens), 1, -1), device)
            self._window_masks[window] = mask
        return mask


@dataclass(frozen=True)
class PrefillRequest:
    req_id: int
    query_start: int
    query_end: int
    seq_len: int
    num_blocks: int


@dataclass(frozen=True)
class KernelRouting:
    """The compiled kernel attends to every request, this many query tokens per work item."""

    queries_per_item: int


@dataclass(frozen=True)
class BatchPlan:
    decode_chunks: list[DecodeChunk]
    prefill_requests: list[PrefillRequest]
    # [num_items, 4] int32 (block table row, first token, num query tokens, first position), the
    # kernel's work list; owned here so its address stays valid for every layer of the step.
    kernel_items: np.ndarray | None = None

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
    kernel_routing: KernelRouting | None = None,
) -> BatchPlan:
    """Group decodes into chunks of at most ``max_chunk_tokens`` padded context tokens; with
    ``kernel_routing``, every request goes to the kernel instead."""
    query_lens = np.diff(query_start_loc)
    if kernel_routing is not None:
        # python -m benchmarks attention --chunk-lens: the kernel is as fast as or faster than the
        # gathered-K/V SDPA path at every chunk length (1 .. 4096) and context measured.
        req_ids = np.arange(len(query_lens))
        kernel_items = _kernel_items(
            req_ids, query_start_loc, seq_lens, kernel_routing.queries_per_item
        )
        return BatchPlan(decode_chunks=[], prefill_requests=[], kernel_items=kernel_items)
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


def _kernel_items(
    req_ids: np.ndarray, query_start_loc: np.ndarray, seq_lens: np.ndarray, queries_per_item: int
) -> np.ndarray:
    query_lens = (query_start_loc[req_ids + 1] - query_start_loc[req_ids]).astype(np.int64)
    num_tiles = -(-query_lens // queries_per_item)
    item_req_ids = np.repeat(req_ids, num_tiles)
    first_item = np.repeat(np.cumsum(num_tiles) - num_tiles, num_tiles)
    offsets = (np.arange(len(item_req_ids)) - first_item) * queries_per_item
    item_query_lens = np.repeat(query_lens, num_tiles)
    num_queries = np.minimum(queries_per_item, item_query_lens - offsets)
    first_positions = seq_lens[item_req_ids] - item_query_lens + offsets
    items = np.stack(
        [item_req_ids, query_start_loc[item_req_ids] + offsets, num_queries, first_positions],
        axis=1,
    )
    # Most keys first: the kernel hands items out dynamically, so the long ones start early.
    order = np.argsort(-(first_positions + num_queries), kind="stable")
    return np.ascontiguousarray(items[order], dtype=np.int32)


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
                seq_lens=chunk_seq_lens,
                block_size=block_size,
            )
        )
        start = end
    return chunks


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return array_to_device(array, device)
