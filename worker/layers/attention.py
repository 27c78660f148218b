"""The attention layer: the one request-aware op in the model.

Runs in worker processes. The layer owns no parameters but a model's attention sinks (gpt-oss:
one logit per head, this rank's heads under tensor parallelism); the model runner binds its KV
cache tensor
and its backend after the model is built, when the number of KV blocks is known. Everything about
requests (which query attends to which keys, where keys go in the cache) is in the metadata.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from conveyor.worker.attention.backend import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        has_sinks: bool = False,
        tp_rank: int = 0,
        logit_softcap: float | None = None,
    ) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # A query at position p sees the keys at p - sliding_window + 1 .. p (Hugging Face's
        # convention: the window counts the query's own key); None: every earlier key.
        self.sliding_window = sliding_window
        self.tp_rank = tp_rank
        # Gemma 2: each score s becomes c * tanh(s / c) before the softmax.
        self.logit_softcap = logit_softcap
        self.sinks: nn.Parameter | None = None
        if has_sinks:
            self.sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False)
            self.sinks.weight_loader = self._load_sinks  # type: ignore[attr-defined]
        self.kv_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None
        # Set only while the runner captures CUDA graphs (worker/cuda_graphs.py): the model's
        # graphs are cut at every attention call, which runs outside them.
        self.graph_split: Callable[..., torch.Tensor] | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, H*D], k and v [T, KV*D] (or already [T, heads, D]; views are fine) -> [T, H*D]."""
        if self.graph_split is not None:
            return self.graph_split(self, q, k, v, metadata)
        return self.attend(q, k, v, metadata)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The attention itself (what ``forward`` does outside graph capture); with ``out`` (a
        dense [num_tokens, num_heads * head_dim] buffer) the output lands there."""
        if self.backend is None or self.kv_cache is None:
            raise RuntimeError("attention layer used before the runner bound its backend and cache")
        num_tokens = q.shape[0]
        extra = {}
        if out is not None and self.backend.accepts_out:
            extra["out"] = out.view(num_tokens, self.num_heads, self.head_dim)
        output = self.backend.forward(
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
            self.kv_cache,
            metadata,
            self.scale,
            self.sliding_window,
            self.sinks,
            self.logit_softcap,
            **extra,
        )
        output = output.reshape(num_tokens, self.num_heads * self.head_dim)
        if out is not None and output.data_ptr() != out.data_ptr():
            out.copy_(output)
            return out
        return output

    def _load_sinks(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        """This rank's heads' slice of the checkpoint's [num_heads] sinks."""
        size = param.shape[0]
        part = loaded_weight.narrow(0, self.tp_rank * size, size)
        if part.shape != param.shape:
            raise ValueError(f"sinks: checkpoint {tuple(loaded_weight.shape)}, layer {size} heads")
        param.data.copy_(part)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, scale={self.scale:.4g}, "
            f"sliding_window={self.sliding_window}, sinks={self.sinks is not None}"
        )
