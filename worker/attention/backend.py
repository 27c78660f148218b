"""The attention backend interface and the per-step metadata every backend reads.

Runs in worker processes. The model runner builds one ``AttentionMetadata`` per step for the flat
token stream (all scheduled tokens of all requests, request after request); every attention layer
passes it to its backend together with that layer's KV cache tensor.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """Where each scheduled token goes and what each request's queries may attend to.

    Requests appear in the flat stream in order; request i owns query rows
    ``query_start_loc[i]:query_start_loc[i+1]``, which are its tokens at positions
    ``seq_lens[i] - query_len_i .. seq_lens[i] - 1``. A query attends causally to every earlier
    token of its own request, whether computed in an earlier step (prefix cache, previous chunks)
    or in this one.
    """

    num_actual_tokens: int
    # [num_tokens] int64: block_id * block_size + offset, where each token's K/V is written.
    slot_mapping: torch.Tensor
    # [num_reqs + 1] int32: cumulative query lengths (cu_seqlens_q).
    query_start_loc: torch.Tensor
    # [num_reqs] int32: context length after this step (computed + scheduled).
    seq_lens: torch.Tensor
    # [num_reqs, max_blocks_per_req] int32: a request's KV blocks in order; unused tail is 0.
    block_table: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # Host copies, so CPU-side planning needs no device synchronisation.
    query_start_loc_cpu: np.ndarray
    seq_lens_cpu: np.ndarray

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(ABC):
    name: str = "abstract"
    # Whether forward takes ``out=``, a dense [num_tokens, num_heads, head_dim] buffer to write
    # the output into (CUDA graph pieces read attention's output from fixed buffers).
    accepts_out: bool = False
    # Whether a decode-only step's attention may be captured in a CUDA graph with the whole
    # forward (worker/cuda_graphs.py): it launches from fixed device buffers alone, and a
    # padding request (one query token, context 0, slot -1) writes nothing to the cache and
    # zeros to its row. Else the graphs are cut at every attention call, which runs eagerly
    # between them.
    full_decode_graphs: bool = False
    # Whether forward takes attention sinks (models with them cannot use a backend without).
    supports_sinks: bool = True

    @staticmethod
    @abstractmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor (keys and values together)."""

    @staticmethod
    def supports_block_size(block_size: int) -> bool:
        return True

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # kv_cache_shape(...)
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,  # [num_heads]
        softcap: float | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write this step's keys and values into the cache, then attend (causal, GQA-aware).

        With ``sliding_window`` W a query at position p sees only the keys at p - W + 1 .. p.
        ``sinks`` (gpt-oss) is one logit per head that joins every softmax denominator with a
        zero value: attention may go "nowhere". Backends without them refuse at selection.
        ``softcap`` c (Gemma 2) maps every score s (already scaled) to c * tanh(s / c).
        """
