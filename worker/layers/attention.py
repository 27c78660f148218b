"""The attention layer: the one request-aware op in the model.

Runs in worker processes. The layer owns no parameters; the model runner binds its KV cache tensor
and its backend after the model is built, when the number of KV blocks is known. Everything about
requests (which query attends to which keys, where keys go in the cache) is in the metadata.
"""

from __future__ import annotations

import torch
from torch import nn

from worker.attention.backend import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
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
        self.kv_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, H*D], k and v [T, KV*D] (or already [T, heads, D]; views are fine) -> [T, H*D]."""
        if self.backend is None or self.kv_cache is None:
            raise RuntimeError("attention layer used before the runner bound its backend and cache")
        num_tokens = q.shape[0]
        output = self.backend.forward(
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
            self.kv_cache,
            metadata,
            self.scale,
            self.sliding_window,
        )
        return output.reshape(num_tokens, self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, scale={self.scale:.4g}, "
            f"sliding_window={self.sliding_window}"
        )
