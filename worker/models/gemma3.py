"""Gemma 3, text only (``Gemma3ForCausalLM``, model_type ``gemma3_text``: the 1B model), and
Gemma 2 (``Gemma2ForCausalLM``), the same block without q/k norms, with one RoPE for every layer
and a soft-cap on the attention logits.

Runs in worker processes. The block differs from Llama's enough to be written out here:

- RMSNorms scale by (1 + weight), in float32 (``GemmaRMSNorm``), and there are four per layer:
  before attention, on the attention output before its residual add, before the MLP, and on the
  MLP output before its residual add. Queries and keys get a per-head one too.
- The embedding is multiplied by sqrt(hidden_size), rounded to the model dtype as transformers
  rounds it; the LM head is the (unscaled) embedding.
- Attention scales by ``query_pre_attn_scalar ** -0.5``, not head_dim ** -0.5.
- The MLP is GeGLU with the tanh approximation of GELU.
- Layers alternate, per ``layer_types``, between sliding-window attention (``sliding_window``
  tokens) and global attention, and each kind has its own RoPE: global layers use
  ``rope_theta`` with its scaling (linear, factor 8, on the larger models), sliding layers the
  local base (``rope_local_base_freq``). transformers 5 keeps both in ``rope_parameters`` keyed by
  layer kind; the model looks up both tables once per step.
- ``final_logit_softcapping`` (None in Gemma 3, 30 in Gemma 2) caps the logits: c * tanh(x / c);
  ``attn_logit_softcapping`` (Gemma 2: 50) caps each attention score the same way, in every
  backend (the CPU kernel per score, the torch path on materialised scores, flash-attn's
  ``softcap``).

The selective-batching layout is the decoder's: every op but attention on the flat token stream,
the residual add folded into the next norm, and ``output_rows`` finishing only the sampled rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from conveyor.worker.attention.backend import AttentionMetadata
from conveyor.worker.layers import (
    Attention,
    GeluAndMul,
    GemmaRMSNorm,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RotaryAngles,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    gemma_rms_normalize,
    rope_parameters_of,
    rotate_,
)
from conveyor.worker.models.decoder import DecoderForCausalLM, head_dim_of, layer_sliding_windows

SLIDING, GLOBAL = "sliding_attention", "full_attention"


def check_supported(config: Any) -> None:
    """Refuse, at load, the settings transformers honours and we do not."""
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention is not supported (causal attention only)")
    activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation {activation!r} is not supported (gelu_pytorch_tanh)")


class Gemma3Attention(nn.Module):
    def __init__(
        self,
        config: Any,
        tp_rank: int,
        tp_size: int,
        sliding_window: int | None,
        qk_norm: bool = True,
    ) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        self.head_dim = head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias,
            tp_rank,
            tp_size,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim, config.hidden_size, bias, tp_rank, tp_size
        )
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        # The q and k norm scales side by side, one row per head: [heads + kv_heads, head_dim].
        self.qk_norm_scale: torch.Tensor | None = None
        self.attn = Attention(
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            head_dim,
            config.query_pre_attn_scalar**-0.5,
            sliding_window,
            logit_softcap=getattr(config, "attn_logit_softcapping", None),
        )

    def process_weights_after_loading(self) -> None:
        if self.qk_norm:
            self.qk_norm_scale = self._stacked_qk_norm_scale()

    def _stacked_qk_norm_scale(self) -> torch.Tensor:
        num_heads, num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        q_scale = GemmaRMSNorm.scale_of(self.q_norm.weight).expand(num_heads, self.head_dim)
        k_scale = GemmaRMSNorm.scale_of(self.k_norm.weight).expand(num_kv_heads, self.head_dim)
        return torch.cat([q_scale, k_scale])

    def attend(
        self, angles: RotaryAngles, hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Everything up to the output projection: [T, hidden] -> [T, heads * head_dim]."""
        qkv = self.qkv_proj(hidden)
        num_tokens, q_size, kv_size = qkv.shape[0], self.qkv_proj.q_size, self.qkv_proj.kv_size
        # Queries and keys side by side: one norm and one rotation for both (see decoder.py).
        qk = qkv[:, : q_size + kv_size].view(num_tokens, -1, self.head_dim)
        if self.qk_norm:
            scale = self.qk_norm_scale
            if scale is None:  # weights loaded without process_weights_after_loading
                scale = self._stacked_qk_norm_scale()
            qk = gemma_rms_normalize(qk, scale, self.q_norm.eps)
        # In place: qk is the fresh norm output or a slice of qkv, this layer's own buffer.
        qk = rotate_(qk, angles)
        num_heads = self.qkv_proj.num_heads
        v = qkv[:, q_size + kv_size :]
        return self.attn(qk[:, :num_heads], qk[:, num_heads:], v, metadata)


class Gemma3MLP(nn.Module):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, config: Any, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], False, tp_rank, tp_size
        )
        self.act_fn = GeluAndMul(approximate="tanh")
        self.down_proj = RowParallelLinear(size, config.hidden_size, False, tp_rank, tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        tp_rank: int,
        tp_size: int,
        sliding_window: int | None,
        qk_norm: bool = True,
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = Gemma3Attention(config, tp_rank, tp_size, sliding_window, qk_norm)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = Gemma3MLP(config, tp_rank, tp_size)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self,
        angles: RotaryAngles,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (normed MLP output, residual), for every row or, given ``output_rows``, only those.

        The caller adds the two (in the next layer's input norm, or the final norm).
        """
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn.attend(angles, hidden, metadata)
        if output_rows is not None:  # attention saw every row; the rest is token-wise
            hidden, residual = hidden[output_rows], residual[output_rows]
        hidden = self.post_attention_layernorm(self.self_attn.o_proj(hidden))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3Model(nn.Module):
    def __init__(self, config: Any, tp_rank: int, tp_size: int, qk_norm: bool = True) -> None:
        super().__init__()
        check_supported(config)
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp_rank, tp_size
        )
        # transformers keeps sqrt(hidden) as a float32 tensor and rounds it to the model dtype
        # (bfloat16 turns sqrt(1152) = 33.94 into 34.0); forward does the same.
        self.register_buffer(
            "embed_scale",
            torch.tensor(config.hidden_size**0.5, dtype=torch.float32),
            persistent=False,
        )
        head_dim, max_position = head_dim_of(config), config.max_position_embeddings
        # One table per layer kind, shared by every layer of that kind.
        self.rotary_embs = nn.ModuleDict(
            {
                kind: RotaryEmbedding(head_dim, max_position, rope_parameters_of(config, kind))
                for kind in (GLOBAL, SLIDING)
            }
        )
        windows = layer_sliding_windows(config)
        self.layer_kinds = [GLOBAL if window is None else SLIDING for window in windows]
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, tp_rank, tp_size, window, qk_norm) for window in windows
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * self.embed_scale.to(hidden.dtype)
        angles = {
            kind: rotary.angles(positions, hidden.dtype)
            for kind, rotary in self.rotary_embs.items()
            if kind in self.layer_kinds
        }
        residual = None
        last = len(self.layers) - 1
        for i, (layer, kind) in enumerate(zip(self.layers, self.layer_kinds)):
            rows = output_rows if i == last else None
            hidden, residual = layer(angles[kind], hidden, residual, metadata, rows)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Gemma3ForCausalLM(DecoderForCausalLM):
    """The decoder's interface (loading, attention layers, KV window) over Gemma 3's block."""

    def build_model(self, hf_config: Any, tp_rank: int, tp_size: int) -> nn.Module:
        return Gemma3Model(hf_config, tp_rank, tp_size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap is not None:  # in the model dtype, as transformers does, before the float cast
            logits = torch.tanh(logits / cap) * cap
        return logits.float()


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2 (2B, 9B, 27B): Gemma 3's block without q/k norms. Its one RoPE is read for both
    layer kinds (``rope_parameters`` is not nested by kind), and its ``attn_logit_softcapping``
    reaches every attention layer."""

    def build_model(self, hf_config: Any, tp_rank: int, tp_size: int) -> nn.Module:
        return Gemma3Model(hf_config, tp_rank, tp_size, qk_norm=False)
