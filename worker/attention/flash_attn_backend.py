"""Paged attention through flash-attn 2's varlen kernel, for CUDA.

Runs in worker processes. flash_attn is imported lazily, on first use, so this module imports
anywhere (CPU machines included). The kernel reads the paged cache itself through the block
table, one layout per K and V: ``(num_blocks, block_size, num_kv_heads, head_dim)``, stacked here as
``(2, num_blocks, block_size, num_kv_heads, head_dim)``. flash-attn 2 accepts paged KV only with a
block size that is a multiple of 256, and only float16 / bfloat16 tensors.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import torch

from conveyor.worker.attention.backend import AttentionBackend, AttentionMetadata

FLASH_BLOCK_SIZE_MULTIPLE = 256
FLASH_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def flash_attn_import_error() -> str | None:
    """None when flash_attn imports, else why not (for logs and error messages)."""
    try:
        importlib.import_module("flash_attn")
    except Exception as error:  # an ImportError, or a broken CUDA extension raising anything
        return f"{type(error).__name__}: {error}"
    return None


@functools.cache
def _varlen_func() -> Callable[..., torch.Tensor]:
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


class FlashAttnBackend(AttentionBackend):
    name = "flash-attn"
    supports_sinks = False

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    @staticmethod
    def supports_block_size(block_size: int) -> bool:
        return block_size % FLASH_BLOCK_SIZE_MULTIPLE == 0

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
        if sinks is not None:  # ruled out at selection (supports_sinks)
            raise ValueError("flash-attn 2 has no attention sinks")
        num_tokens = metadata.num_actual_tokens
        key_cache, value_cache = kv_cache.unbind(0)
        _write_kv(key_cache, value_cache, key, value, metadata.slot_mapping, num_tokens)
        # With a block table, cu_seqlens_k only gives each request's context length (the
        # kernel finds the keys through the table); computed on the device, so no sync.
        seq_lens = metadata.seq_lens
        cu_seqlens_k = torch.cat([seq_lens.new_zeros(1), seq_lens.cumsum(0, dtype=torch.int32)])
        attended = _varlen_func()(
            query[:num_tokens],
            key_cache,
            value_cache,
            cu_seqlens_q=metadata.query_start_loc,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=metadata.max_query_len,
            max_seqlen_k=metadata.max_seq_len,
            softmax_scale=scale,
            causal=True,
            # flash-attn counts the keys left of the query's own: W - 1 for our window W. Keys
            # outside it are never read, so blocks freed behind the window are safe.
            window_size=(-1, -1) if sliding_window is None else (sliding_window - 1, 0),
            softcap=softcap or 0.0,  # flash-attn >= 2.6; 0 means none
            block_table=metadata.block_table,
        )
        if num_tokens == query.shape[0]:
            return attended
        output = torch.zeros_like(query)
        output[:num_tokens] = attended
        return output


def _write_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_tokens: int,
) -> None:
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    slots = slot_mapping[:num_tokens]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key[:num_tokens])
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value[:num_tokens])
