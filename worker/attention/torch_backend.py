"""Paged attention for CPU and CUDA over a mixed batch in one call: torch ops, and on CPU a kernel.

Runs in worker processes. The cache layout puts KV heads outermost,
``(2, num_kv_heads, num_blocks, block_size, head_dim)``, because gathering a request's blocks
then yields ``[kv_heads, tokens, head_dim]`` with each head's keys contiguous: exactly the shape
the attention matmuls read, without a second copy. Decode rows (query length 1) are handled
together in a few chunks; requests with longer queries (prompt chunks) one by one. Both use
``scaled_dot_product_attention``, which on CPU runs a flash-style kernel.

On CPU with float32 or bfloat16, a compiled kernel (cpu_kernel.py) takes every query instead,
decodes and prompt chunks in one call: it reads K/V through the block table where they lie, so
the gathers (a copy of every request's whole context, each layer, each step) and the prompt
chunks' masks disappear. Where it cannot be built this file's torch path runs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from conveyor.worker.attention.backend import AttentionBackend, AttentionMetadata
from conveyor.worker.attention.batch_plan import (
    BatchPlan,
    DecodeChunk,
    KernelRouting,
    PrefillRequest,
    plan_batch,
)
from conveyor.worker.attention.cpu_kernel import PagedAttentionKernel, load_kernel

# Gathered K+V bytes per decode chunk. On CPU a chunk this size stays in the L3 cache between the
# gather and the attention that reads it: for 64 decodes at ctx 128-256 (AMD EPYC, 1 and 2
# threads) 4-8 MiB chunks were fastest, 1 MiB chunks or one 24 MiB gather ~1.5x slower. On CUDA
# there is no such cache to fit; the budget there only bounds the transient gather buffer, which
# the memory profiling pass does not see, to a small slice of the memory left outside the cache.
_CPU_DECODE_CHUNK_BYTES = 4 << 20
_CUDA_DECODE_CHUNK_BYTES = 64 << 20
# Query rows per score matrix when attention sinks or a logit soft-cap force the scores to be
# materialised (SDPA has neither): bounds it to heads x 256 x context floats for any chunk.
_EXPLICIT_QUERY_CHUNK = 256


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(
        self, decode_chunk_bytes: int | None = None, use_cpu_kernel: bool | None = None
    ) -> None:
        # Tests pass a small budget to force many decode chunks; None means the device default.
        self._decode_chunk_bytes = decode_chunk_bytes
        # None or True: use the compiled CPU kernel where it builds (unless CONVEYOR_CPU_KERNEL=0);
        # False: never. Loaded on the first CPU forward, so CUDA workers never compile it.
        self._use_cpu_kernel = use_cpu_kernel
        self.cpu_kernel: PagedAttentionKernel | None = None
        # The plan depends only on the host copies of the metadata, so all layers of a step share
        # one; remembered by the arrays' contents, not identity, in case the runner reuses them.
        self._plan_key: tuple[object, ...] | None = None
        self._plan: BatchPlan | None = None
        self._workspace: torch.Tensor | None = None

    def load_cpu_kernel(self, dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
        """Build (or load from the cache) the compiled kernel now, at the worker's start-up,
        rather than in the first step, which a request would wait for."""
        if self._use_cpu_kernel is not False:
            self.cpu_kernel = load_kernel(dtype, kv_dtype)

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (2, num_kv_heads, num_blocks, block_size, head_dim)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        num_tokens = metadata.num_actual_tokens
        kernel = self._kernel_for(query, kv_cache)
        # Every write lands before any read: a request may attend to a shared prefix block that
        # another request of this same step is filling.
        keys, values = key[:num_tokens], value[:num_tokens]
        if kernel is not None and keys.dtype == values.dtype == kernel.dtype:
            kernel.write_kv(kv_cache, keys, values, metadata.slot_mapping[:num_tokens])
        else:
            write_kv(kv_cache, keys, values, metadata.slot_mapping[:num_tokens])
        plan = self._plan_for(metadata, query, kv_cache, kernel)
        # Dense whatever the query's strides (it may be a view into a fused qkv projection).
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        output[num_tokens:].zero_()
        if kernel is not None and plan.kernel_items is not None and len(plan.kernel_items):
            kernel.attend(
                query,
                kv_cache,
                metadata.block_table,
                plan.kernel_items,
                scale,
                output,
                sliding_window,
                sinks,
                softcap,
            )
        workspace = self._decode_workspace(plan, kv_cache)
        scores = _ScoreChanges.of(sinks, softcap)
        for chunk in plan.decode_chunks:
            _attend_decode_chunk(
                query, kv_cache, metadata, chunk, scale, output, workspace, sliding_window, scores
            )
        for request in plan.prefill_requests:
            _attend_prefill(
                query,
                key,
                value,
                kv_cache,
                metadata,
                request,
                scale,
                output,
                sliding_window,
                scores,
            )
        return output

    def _decode_workspace(self, plan: BatchPlan, kv_cache: torch.Tensor) -> torch.Tensor | None:
        """On CPU, a buffer reused by every decode gather: fresh multi-MB allocations each chunk
        cost page faults and cold cache lines, ~20% of the decode time. CUDA's caching allocator
        already reuses memory, and a buffer held there would sit outside the profiled budget."""
        if kv_cache.is_cuda:
            return None
        _, num_kv_heads, _, block_size, head_dim = kv_cache.shape
        size = plan.max_decode_chunk_blocks * 2 * num_kv_heads * block_size * head_dim
        workspace = self._workspace
        if (
            workspace is None
            or workspace.numel() < size
            or (workspace.dtype, workspace.device) != (kv_cache.dtype, kv_cache.device)
        ):
            workspace = torch.empty(size, dtype=kv_cache.dtype, device=kv_cache.device)
            self._workspace = workspace
        return workspace

    def _kernel_for(
        self, query: torch.Tensor, kv_cache: torch.Tensor
    ) -> PagedAttentionKernel | None:
        if self._use_cpu_kernel is False or kv_cache.is_cuda:
            return None
        kernel = self.cpu_kernel
        if kernel is None or (kernel.dtype, kernel.kv_dtype) != (query.dtype, kv_cache.dtype):
            # One build per (model dtype, cache dtype); a model runs one pair, so this loads once.
            kernel = load_kernel(query.dtype, kv_cache.dtype)
            if kernel is None:
                return None
            self.cpu_kernel = kernel
        return kernel if kernel.supports(query, kv_cache) else None

    def _plan_for(
        self,
        metadata: AttentionMetadata,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        kernel: PagedAttentionKernel | None,
    ) -> BatchPlan:
        # Builds differ in query tokens per work item.
        per_item = (
            None if kernel is None else kernel.queries_per_item(query.shape[1], kv_cache.shape[1])
        )
        key = (
            metadata.query_start_loc_cpu.tobytes(),
            metadata.seq_lens_cpu.tobytes(),
            tuple(kv_cache.shape),
            str(kv_cache.dtype),
            str(kv_cache.device),
            query.shape[1],
            per_item,
        )
        if self._plan is None or key != self._plan_key:
            default_bytes = (
                _CUDA_DECODE_CHUNK_BYTES if kv_cache.is_cuda else _CPU_DECODE_CHUNK_BYTES
            )
            chunk_bytes = self._decode_chunk_bytes or default_bytes
            token_bytes = 2 * kv_cache.shape[1] * kv_cache.shape[4] * kv_cache.element_size()
            routing = None if per_item is None else KernelRouting(per_item)
            self._plan = plan_batch(
                metadata.query_start_loc_cpu,
                metadata.seq_lens_cpu,
                block_size=kv_cache.shape[3],
                max_chunk_tokens=max(1, chunk_bytes // token_bytes),
                device=kv_cache.device,
                kernel_routing=routing,
            )
            self._plan_key = key
        return self._plan


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store each token's key and value at its slot (block_id * block_size + offset)."""
    _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
    slots = kv_cache.view(2, num_kv_heads, num_blocks * block_size, head_dim)
    # A cache of another dtype (--kv-cache-dtype) holds each element rounded to its own.
    slots[0].index_copy_(1, slot_mapping, key.transpose(0, 1).to(kv_cache.dtype))
    slots[1].index_copy_(1, slot_mapping, value.transpose(0, 1).to(kv_cache.dtype))


def _gather_blocks(
    kv_cache: torch.Tensor,
    block_ids: torch.Tensor,
    num_seqs: int,
    workspace: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``num_seqs`` requests as [kv_heads, num_seqs, num_blocks * block_size, dim],
    in ``dtype`` (default: the cache's)."""
    _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
    # One gather of whole blocks for K and V of every head, as rows of a 2-D view: index_select
    # on dim 0 runs at memcpy speed, about twice as fast as selecting on an inner dim.
    rows = kv_cache.view(-1, block_size * head_dim)
    first_rows = torch.arange(2 * num_kv_heads, device=kv_cache.device) * num_blocks
    row_ids = (first_rows[:, None] + block_ids[None, :]).reshape(-1)
    if workspace is None:
        gathered = rows.index_select(0, row_ids)
    else:
        out = workspace[: row_ids.shape[0] * block_size * head_dim].view(row_ids.shape[0], -1)
        gathered = torch.index_select(rows, 0, row_ids, out=out)
    kv = gathered.view(2, num_kv_heads, num_seqs, -1, head_dim)
    if dtype is not None and dtype != kv.dtype:  # a cache of another dtype: widen what was read
        kv = kv.to(dtype)
    return kv[0], kv[1]


def _attend_decode_chunk(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    chunk: DecodeChunk,
    scale: float,
    output: torch.Tensor,
    workspace: torch.Tensor | None,
    sliding_window: int | None = None,
    scores: _ScoreChanges | None = None,
) -> None:
    num_seqs = chunk.token_ids.shape[0]
    num_kv_heads, head_dim = kv_cache.shape[1], kv_cache.shape[4]
    block_ids = metadata.block_table[chunk.req_ids, : chunk.num_blocks].reshape(-1)
    keys, values = _gather_blocks(kv_cache, block_ids, num_seqs, workspace, query.dtype)
    # The query heads that share a KV head become that head's "query length", so one batched
    # matmul over (kv_head, request) serves the whole GQA group with no KV copies.
    q = query.index_select(0, chunk.token_ids).view(num_seqs, num_kv_heads, -1, head_dim)
    # Windowed: the gather still starts at block 0 (a chunk pads every member to one length),
    # and the mask hides what lies behind each member's window, blocks since reused included.
    mask = chunk.mask if sliding_window is None else chunk.window_mask(sliding_window)
    if scores is None:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys, values, attn_mask=mask, scale=scale
        )
    else:  # [kv_heads, num_seqs, group, head_dim] queries: the sink of head (kv_head, g)
        sink = None if scores.sinks is None else scores.sinks.view(num_kv_heads, 1, -1, 1)
        out = _explicit_attention(
            q.transpose(0, 1), keys, values, mask, scale, sink, scores.softcap
        )
    output.index_copy_(0, chunk.token_ids, out.transpose(0, 1).reshape(num_seqs, -1, head_dim))


def _attend_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    request: PrefillRequest,
    scale: float,
    output: torch.Tensor,
    sliding_window: int | None = None,
    scores: _ScoreChanges | None = None,
) -> None:
    start, end, seq_len = request.query_start, request.query_end, request.seq_len
    query_len = end - start
    q = query[start:end].transpose(0, 1).unsqueeze(0)
    if sliding_window is not None and seq_len > sliding_window:
        _attend_prefill_windowed(
            query, kv_cache, metadata, request, scale, output, sliding_window, scores
        )
        return
    if seq_len == query_len:
        # Nothing cached before this chunk: its own keys are the whole context, no gather. With
        # a cache of another dtype they are what the cache holds, as the kernel reads them.
        keys = as_cached(key[start:end], kv_cache).transpose(0, 1).unsqueeze(0)
        values = as_cached(value[start:end], kv_cache).transpose(0, 1).unsqueeze(0)
        out = _prefill_attention(q, keys, values, None, scale, scores)
    else:
        block_ids = metadata.block_table[request.req_id, : request.num_blocks]
        keys, values = _gather_blocks(kv_cache, block_ids, 1, dtype=query.dtype)
        keys, values = keys[:, :, :seq_len].transpose(0, 1), values[:, :, :seq_len].transpose(0, 1)
        # Causal with the cached prefix in front: query i sees keys 0 .. seq_len - query_len + i.
        mask = torch.ones(query_len, seq_len, dtype=torch.bool, device=q.device)
        mask = mask.tril(seq_len - query_len)
        out = _prefill_attention(q, keys, values, mask, scale, scores)
    output[start:end] = out[0].transpose(0, 1)


def as_cached(rows: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """``rows`` as the cache holds them: rounded to its dtype (and back) where it differs."""
    if rows.dtype == kv_cache.dtype:
        return rows
    return rows.to(kv_cache.dtype).to(rows.dtype)


def _attend_prefill_windowed(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    request: PrefillRequest,
    scale: float,
    output: torch.Tensor,
    window: int,
    scores: _ScoreChanges | None = None,
) -> None:
    """A prompt chunk under a sliding window: query i (position p) sees keys p - window + 1 .. p.

    Reads the cache (this step's keys are already written) from the first block the chunk's
    earliest query can see: blocks further back may have been freed and reused.
    """
    start, end, seq_len = request.query_start, request.query_end, request.seq_len
    query_len = end - start
    block_size = kv_cache.shape[3]
    first_position = seq_len - query_len
    first_block = max(0, first_position - window + 1) // block_size
    offset = first_block * block_size
    block_ids = metadata.block_table[request.req_id, first_block : request.num_blocks]
    keys, values = _gather_blocks(kv_cache, block_ids, 1, dtype=query.dtype)
    num_keys = seq_len - offset
    keys, values = keys[:, :, :num_keys].transpose(0, 1), values[:, :, :num_keys].transpose(0, 1)
    query_positions = torch.arange(first_position, seq_len, device=query.device)[:, None]
    key_positions = torch.arange(offset, seq_len, device=query.device)[None, :]
    distance = query_positions - key_positions
    mask = (distance >= 0) & (distance < window)
    q = query[start:end].transpose(0, 1).unsqueeze(0)
    out = _prefill_attention(q, keys, values, mask, scale, scores)
    output[start:end] = out[0].transpose(0, 1)


def _prefill_attention(
    q: torch.Tensor,  # [1, heads, query_len, head_dim]
    keys: torch.Tensor,  # [1, kv_heads, num_keys, head_dim]
    values: torch.Tensor,
    mask: torch.Tensor | None,  # [query_len, num_keys] bool; None: causal, num_keys == query_len
    scale: float,
    scores: _ScoreChanges | None,
    repeat_kv_heads: bool | None = None,
) -> torch.Tensor:
    if scores is None:
        if mask is None:
            return F.scaled_dot_product_attention(
                q, keys, values, is_causal=True, scale=scale, enable_gqa=True
            )
        if q.is_cuda if repeat_kv_heads is None else repeat_kv_heads:
            # On CUDA, SDPA serves a mask with enable_gqa only by its math kernel, which
            # materialises every head's [query_len, num_keys] scores (gigabytes at long
            # contexts); with the KV heads repeated the memory-efficient kernel takes the mask
            # and never holds the scores. The copy is group x this chunk's gathered K/V.
            group = q.shape[1] // keys.shape[1]
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
    _, num_heads, query_len, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    if mask is None:
        mask = torch.ones(query_len, keys.shape[2], dtype=torch.bool, device=q.device).tril()
    # GQA without copies: each KV head's group of query heads as one batch entry.
    grouped = q[0].view(num_kv_heads, -1, query_len, head_dim)
    keys, values = keys[0].unsqueeze(1), values[0].unsqueeze(1)
    sink = None if scores.sinks is None else scores.sinks.view(num_kv_heads, -1, 1, 1)
    out = torch.empty_like(grouped)
    for first in range(0, query_len, _EXPLICIT_QUERY_CHUNK):
        rows = slice(first, first + _EXPLICIT_QUERY_CHUNK)
        out[:, :, rows] = _explicit_attention(
            grouped[:, :, rows], keys, values, mask[rows], scale, sink, scores.softcap
        )
    return out.view(1, num_heads, query_len, head_dim)


def _explicit_attention(
    q: torch.Tensor,  # [..., query_len, head_dim]
    keys: torch.Tensor,  # [..., num_keys, head_dim], broadcasting against q's leading dims
    values: torch.Tensor,
    visible: torch.Tensor | None,  # bool, broadcasting to [..., query_len, num_keys]
    scale: float,
    sink: torch.Tensor | None,  # broadcasting to [..., query_len, 1]
    softcap: float | None,
) -> torch.Tensor:
    """Softmax attention over materialised scores, for what SDPA cannot do: a soft-cap (Gemma 2:
    s -> c * tanh(s / c)) and a sink logit joining the denominator with a zero value (gpt-oss)."""
    scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(scale)
    if softcap is not None:
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    if visible is not None:
        scores.masked_fill_(~visible, float("-inf"))
    if sink is None:
        probs = scores.softmax(dim=-1)
    else:
        sink = sink.to(scores.dtype).expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(probs.to(values.dtype), values)


class _ScoreChanges(NamedTuple):
    """What a layer changes in the scores, forcing the explicit path; None when nothing does."""

    sinks: torch.Tensor | None
    softcap: float | None

    @staticmethod
    def of(sinks: torch.Tensor | None, softcap: float | None) -> _ScoreChanges | None:
        return None if sinks is None and softcap is None else _ScoreChanges(sinks, softcap)
