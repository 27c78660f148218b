"""The pre-norm decoder-only transformer that Llama, Mistral, Qwen2, Qwen3 and Phi-3 share.

Runs in worker processes. The families differ only in a few switches (``DecoderSpec``): biases on
the q/k/v projections, an RMSNorm on every query and key head (Qwen3), biases in the MLP. Each
family file names its switches; this file is the model, top to bottom. The mixtures of experts
(Qwen3-MoE, Mixtral) are this model with their own MLP in some or all layers (``make_mlp``).

Selective batching: every op but attention works on the flat stream of all scheduled tokens of all
requests, [T, hidden]; attention alone reads the per-request metadata.

The token-wise ops are most of a CPU step, so the layers skip work the arithmetic does not need:
the RoPE angles are looked up once per step, not per layer; queries and keys are normalised and
rotated together, in place, in the projection's buffer; and given ``output_rows`` (the rows that
will be sampled) the last layer finishes only those.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from conveyor.worker.attention.backend import AttentionMetadata
from conveyor.worker.layers import (
    Attention,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryAngles,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
    normalize_and_rotate,
)
from conveyor.worker.models.checkpoint import checkpoint_names, load_checkpoint

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecoderSpec:
    """What one family does differently from plain Llama."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    mlp_bias: bool = False
    # One learned logit per head in every softmax denominator (gpt-oss).
    attention_sinks: bool = False


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_sliding_windows(config: Any) -> list[int | None]:
    """Each layer's attention window (None: global), as transformers reads the config.

    transformers 5 names every layer's kind in ``layer_types`` ("sliding_attention" or
    "full_attention"); a config without it (Mistral, Mixtral, Phi-3) windows every layer when
    ``sliding_window`` is set. Qwen2/Qwen3 configs already fold ``use_sliding_window`` and
    ``max_window_layers`` into ``layer_types`` and clear ``sliding_window`` when it is off.
    """
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    num_layers = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None)
    if window is None:
        return [None] * num_layers
    if layer_types is None:
        return [window] * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"layer types {sorted(unknown)} are not supported")
    return [window if kind == "sliding_attention" else None for kind in layer_types]


def kv_sliding_window(windows: list[int | None]) -> int | None:
    """The window the KV cache may drop blocks behind: the widest, or None if any layer is global.

    One block table serves every layer of a request, so a block may be freed only once it is out
    of every layer's window.
    """
    if not windows or any(window is None for window in windows):
        return None
    return max(windows)  # type: ignore[type-var]


class DecoderAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        spec: DecoderSpec,
        rotary_emb: RotaryEmbedding,
        tp_rank: int,
        tp_size: int,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        self.head_dim = head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            spec.qkv_bias,
            tp_rank,
            tp_size,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim, config.hidden_size, spec.o_bias, tp_rank, tp_size
        )
        self.qk_norm = spec.qk_norm
        if spec.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        # The q and k norm weights side by side, one row per head: [heads + kv_heads, head_dim].
        self.qk_norm_weight: torch.Tensor | None = None
        self.rotary_emb = rotary_emb  # one table shared by every layer
        self.attn = Attention(
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            head_dim,
            head_dim**-0.5,
            sliding_window,
            has_sinks=spec.attention_sinks,
            tp_rank=tp_rank,
        )

    def process_weights_after_loading(self) -> None:
        if self.qk_norm:
            self.qk_norm_weight = self._stacked_qk_norm_weight()

    def _stacked_qk_norm_weight(self) -> torch.Tensor:
        num_heads, num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        q_weight = self.q_norm.weight.expand(num_heads, self.head_dim)
        return torch.cat([q_weight, self.k_norm.weight.expand(num_kv_heads, self.head_dim)])

    def forward(
        self, angles: RotaryAngles, hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        return self.o_proj(self.attend(angles, hidden, metadata))

    def attend(
        self, angles: RotaryAngles, hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Everything up to the output projection: [T, hidden] -> [T, heads * head_dim]."""
        qkv = self.qkv_proj(hidden)
        num_tokens, q_size, kv_size = qkv.shape[0], self.qkv_proj.q_size, self.qkv_proj.kv_size
        # Queries and keys sit side by side in the projection's output: one [T, H + KV, D] view
        # lets them be normalised and rotated by one op each instead of two.
        qk = qkv[:, : q_size + kv_size].view(num_tokens, -1, self.head_dim)
        weight = None
        if self.qk_norm:
            weight = self.qk_norm_weight
            if weight is None:  # weights loaded without process_weights_after_loading
                weight = self._stacked_qk_norm_weight()
        # In place where it can: qk is a slice of qkv, this layer's own buffer.
        eps = self.q_norm.eps if self.qk_norm else 0.0
        qk = normalize_and_rotate(qk, weight, eps, angles)
        num_heads = self.qkv_proj.num_heads
        v = qkv[:, q_size + kv_size :]
        return self.attn(qk[:, :num_heads], qk[:, num_heads:], v, metadata)


class DecoderMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, config: Any, spec: DecoderSpec, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], spec.mlp_bias, tp_rank, tp_size
        )
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(
            size, config.hidden_size, spec.mlp_bias, tp_rank, tp_size
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        spec: DecoderSpec,
        rotary_emb: RotaryEmbedding,
        tp_rank: int,
        tp_size: int,
        sliding_window: int | None = None,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DecoderAttention(
            config, spec, rotary_emb, tp_rank, tp_size, sliding_window
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Token-wise [T, hidden] -> [T, hidden]: the dense SwiGLU unless the family brings its own.
        self.mlp = mlp if mlp is not None else DecoderMLP(config, spec, tp_rank, tp_size)

    def forward(
        self,
        angles: RotaryAngles,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (MLP output, residual), for every row or, given ``output_rows``, only those."""
        # The residual add is folded into the next norm: (x, r) -> (norm(x + r), x + r).
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        # Attention must see every row (their keys and values go to the cache); what follows is
        # token-wise, so rows nobody reads can be dropped here.
        hidden = self.self_attn.attend(angles, hidden, metadata)
        if output_rows is not None:
            hidden, residual = hidden[output_rows], residual[output_rows]
        hidden = self.self_attn.o_proj(hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(
        self,
        config: Any,
        spec: DecoderSpec,
        tp_rank: int,
        tp_size: int,
        make_mlp: Callable[[int], nn.Module | None] | None = None,
    ) -> None:
        """``make_mlp(layer_index)``: that layer's MLP (mixture-of-experts families), or None
        for the dense one."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp_rank, tp_size
        )
        self.rotary_emb = RotaryEmbedding.from_config(config, head_dim_of(config))
        self.layers = nn.ModuleList(
            DecoderLayer(
                config,
                spec,
                self.rotary_emb,
                tp_rank,
                tp_size,
                window,
                make_mlp(index) if make_mlp is not None else None,
            )
            for index, window in enumerate(layer_sliding_windows(config))
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        angles = self.rotary_emb.angles(positions, hidden.dtype)  # the same for every layer
        residual = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            rows = output_rows if i == last else None
            hidden, residual = layer(angles, hidden, residual, metadata, rows)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(nn.Module):
    """The common interface every model family offers the model runner."""

    @staticmethod
    def decoder_spec(config: Any) -> DecoderSpec:
        raise NotImplementedError

    def __init__(self, hf_config: Any, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.config = hf_config
        self.model = self.build_model(hf_config, tp_rank, tp_size)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, tp_rank, tp_size)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def build_model(self, hf_config: Any, tp_rank: int, tp_size: int) -> nn.Module:
        """The body, embeddings to final norm; a family with its own block (Gemma 3) overrides."""
        return DecoderModel(hf_config, self.decoder_spec(hf_config), tp_rank, tp_size)

    def process_weights_after_loading(self) -> None:
        """Derive what forward reads from the loaded weights (packed copies, stacked norms).

        The loader calls this once every checkpoint tensor is in; a model used without it is
        still correct, only slower.
        """
        for module in self.modules():
            if module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final hidden states [T, hidden].

        With ``output_rows`` (int64 row indices, e.g. the rows to sample from) the result is just
        those rows, [R, hidden], the same values as indexing the full result: the last layer then
        skips its output projection and MLP for every other row, most of a prefill step's last
        layer.
        """
        return self.model(input_ids, positions, metadata, output_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] (the rows to sample from) -> logits [R, vocab] float32."""
        return self.lm_head(hidden).float()

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def kv_sliding_window(self) -> int | None:
        """How far back the KV cache must keep a request's blocks (None: all of them)."""
        return kv_sliding_window([attn.sliding_window for attn in self.attention_layers()])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors in; the names of the parameters now fully loaded."""
        return load_checkpoint(self, weights, self._is_unused)

    def checkpoint_names(self, param_name: str) -> list[str]:
        """The checkpoint tensors that make up one of our parameters."""
        return checkpoint_names(param_name)

    def _is_unused(self, name: str) -> bool:
        # Older checkpoints saved the rotary frequencies; we compute our own. A tied head is the
        # embedding, whatever copy of it a checkpoint also holds.
        return "rotary_emb.inv_freq" in name or (
            self.tie_word_embeddings and name == "lm_head.weight"
        )
