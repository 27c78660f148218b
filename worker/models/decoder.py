"""The pre-norm decoder-only transformer that Llama, Mistral, Qwen2 and Qwen3 share.

Runs in worker processes. The families differ only in a few switches (``DecoderSpec``): biases on
the q/k/v projections, an RMSNorm on every query and key head (Qwen3), biases in the MLP. Each
family file names its switches; this file is the model, top to bottom.

Selective batching: every op but attention works on the flat stream of all scheduled tokens of all
requests, [T, hidden]; attention alone reads the per-request metadata.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from worker.attention.backend import AttentionMetadata
from worker.layers import (
    Attention,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
    default_weight_loader,
)

logger = logging.getLogger(__name__)

# Checkpoint tensors that land in a slice of one of our fused parameters:
# (our parameter, the checkpoint's name for the part, shard id).
STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


@dataclass(frozen=True)
class DecoderSpec:
    """What one family does differently from plain Llama."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    mlp_bias: bool = False


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecoderAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        spec: DecoderSpec,
        rotary_emb: RotaryEmbedding,
        tp_rank: int,
        tp_size: int,
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
        self.rotary_emb = rotary_emb  # one table shared by every layer
        self.attn = Attention(
            self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim, head_dim**-0.5
        )

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        if self.qk_norm:
            num_tokens = hidden.shape[0]
            q = self.q_norm(q.view(num_tokens, -1, self.head_dim)).view(num_tokens, -1)
            k = self.k_norm(k.view(num_tokens, -1, self.head_dim)).view(num_tokens, -1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, metadata))


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
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DecoderAttention(config, spec, rotary_emb, tp_rank, tp_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DecoderMLP(config, spec, tp_rank, tp_size)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add is folded into the next norm: (x, r) -> (norm(x + r), x + r).
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, config: Any, spec: DecoderSpec, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp_rank, tp_size
        )
        rotary_emb = RotaryEmbedding.from_config(config, head_dim_of(config))
        self.layers = nn.ModuleList(
            DecoderLayer(config, spec, rotary_emb, tp_rank, tp_size)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(nn.Module):
    """The common interface every model family offers the model runner."""

    @staticmethod
    def decoder_spec(config: Any) -> DecoderSpec:
        raise NotImplementedError

    @staticmethod
    def sliding_window(config: Any) -> int | None:
        return None

    def __init__(self, hf_config: Any, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.config = hf_config
        self.model = DecoderModel(hf_config, self.decoder_spec(hf_config), tp_rank, tp_size)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, tp_rank, tp_size)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        window = self.sliding_window(hf_config)
        if window is not None and window < hf_config.max_position_embeddings:
            # Every layer here attends to the whole context; within the window that is exact.
            logger.warning(
                "%s: sliding-window attention (%d) is not implemented; sequences longer than the "
                "window will differ from the reference",
                type(self).__name__,
                window,
            )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] (the rows to sample from) -> logits [R, vocab] float32."""
        return self.lm_head(hidden).float()

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (Hugging Face names) into our parameters.

        Returns the names of the parameters that are now fully loaded: a fused parameter counts
        only once every one of its parts has arrived.
        """
        params = dict(self.named_parameters())
        parts_seen: dict[str, set[str | int | None]] = defaultdict(set)
        for name, tensor in weights:
            if self._is_unused(name):
                continue
            param_name, shard_id = self._param_name(name)
            if param_name not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}"
                )
            param = params[param_name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor, shard_id)
            except ValueError as error:
                raise ValueError(f"{name}: {error}") from error
            parts_seen[param_name].add(shard_id)
        return {name for name, seen in parts_seen.items() if seen >= self._parts_of(name)}

    def checkpoint_names(self, param_name: str) -> list[str]:
        """The checkpoint tensors that make up one of our parameters."""
        fused = next((f for f, _, _ in STACKED_PARAMS if f".{f}." in param_name), None)
        if fused is None:
            return [param_name]
        return [
            param_name.replace(f".{fused}.", f".{part}.")
            for f, part, _ in STACKED_PARAMS
            if f == fused
        ]

    def _is_unused(self, name: str) -> bool:
        # Older checkpoints saved the rotary frequencies; we compute our own. A tied head is the
        # embedding, whatever copy of it a checkpoint also holds.
        return "rotary_emb.inv_freq" in name or (
            self.tie_word_embeddings and name == "lm_head.weight"
        )

    @staticmethod
    def _param_name(name: str) -> tuple[str, str | int | None]:
        for fused, part, shard_id in STACKED_PARAMS:
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), shard_id
        return name, None

    @staticmethod
    def _parts_of(param_name: str) -> set[str | int | None]:
        parts = {shard for fused, _, shard in STACKED_PARAMS if f".{fused}." in param_name}
        return parts or {None}
