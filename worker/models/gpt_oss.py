"""gpt-oss (``GptOssForCausalLM``: gpt-oss-20b, gpt-oss-120b): attention sinks, alternating
sliding-window layers, and a mixture of experts stored in MXFP4.

Runs in worker processes. The block is Llama's (pre-norm, RMSNorm, residual adds) with:

- attention: biases on q, k, v and o; one learned sink logit per head that joins every softmax
  denominator with a zero value (worker/layers/attention.py carries it to the backends; flash-attn
  2 has none, so the torch backend serves the model); ``layer_types`` alternate a 128-token
  sliding window with global attention, read per layer by the decoder; YaRN RoPE.
- MLP: a router with a bias picks ``num_experts_per_tok`` of ``num_local_experts`` experts by
  raw logit, and the softmax runs over those k logits only (not over every expert, as Mixtral
  and Qwen3-MoE do). Each expert is a clamped SwiGLU with biases: gate clamped above at
  ``swiglu_limit``, up clamped to +-limit, out = (up + 1) * gate * sigmoid(alpha * gate), alpha
  ``swiglu_alpha`` (1.702).
- checkpoint: the experts' gate/up and down matrices are MXFP4 (``*_blocks`` and ``*_scales``,
  unpacked once at load, worker/layers/mxfp4.py), with gate and up rows interleaved (row 2j is
  gate j, row 2j + 1 up j); a dequantized checkpoint (transformers' layout, ``gate_up_proj``
  [experts, hidden, 2 x inter]) loads too. We de-interleave into the stacked [gate; up] layout
  of worker/layers/fused_moe.py, so expert execution and its tensor-parallel split (each
  expert's intermediate dimension across ranks) are the other MoE families'.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from conveyor.worker.layers.fused_moe import MoEExperts
from conveyor.worker.layers.linear import ReplicatedLinear
from conveyor.worker.layers.mxfp4 import dequantize_mxfp4
from conveyor.worker.layers.parallel import all_reduce
from conveyor.worker.models.checkpoint import checkpoint_names as default_checkpoint_names
from conveyor.worker.models.checkpoint import load_checkpoint
from conveyor.worker.models.decoder import DecoderForCausalLM, DecoderModel, DecoderSpec

# transformers' default when a config leaves swiglu_alpha out.
DEFAULT_SWIGLU_ALPHA = 1.702
_EXPERTS_TENSOR = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_blocks|_scales|)$")


class GptOssExperts(MoEExperts):
    """The stacked experts of fused_moe.py plus per-expert biases and gpt-oss's clamped SwiGLU."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        swiglu_limit: float,
        tp_rank: int = 0,
        tp_size: int = 1,
        swiglu_alpha: float = DEFAULT_SWIGLU_ALPHA,
    ) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size, tp_rank, tp_size)
        self.full_intermediate_size = intermediate_size
        self.swiglu_limit = swiglu_limit
        self.swiglu_alpha = swiglu_alpha
        size = self.intermediate_size
        self.gate_up_proj_bias = nn.Parameter(
            torch.empty(num_experts, 2 * size), requires_grad=False
        )
        self.down_proj_bias = nn.Parameter(
            torch.empty(num_experts, hidden_size), requires_grad=False
        )
        self.gate_up_proj_bias.weight_loader = self._load_gate_up_bias  # type: ignore[attr-defined]
        self.down_proj_bias.weight_loader = self._load_down_bias  # type: ignore[attr-defined]

    def _load_gate_up_bias(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        """[experts, 2 x inter], gate and up interleaved -> this rank's [gate_r; up_r]."""
        size, start = self.intermediate_size, self.tp_rank * self.intermediate_size
        if loaded_weight.shape != (param.shape[0], 2 * self.full_intermediate_size):
            raise ValueError(f"gate_up_proj_bias has shape {tuple(loaded_weight.shape)}")
        param.data[:, :size] = loaded_weight[:, 0::2].narrow(1, start, size)
        param.data[:, size:] = loaded_weight[:, 1::2].narrow(1, start, size)

    def _load_down_bias(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if loaded_weight.shape != param.shape:
            raise ValueError(f"down_proj_bias has shape {tuple(loaded_weight.shape)}")
        param.data.copy_(loaded_weight)

    def _expert(self, rows: torch.Tensor, expert: int) -> torch.Tensor:
        gate_up = self.project(rows, expert, 0, self.gate_up_proj_bias[expert])
        gate, up = gate_up.chunk(2, dim=-1)
        limit = self.swiglu_limit
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        activated = (up + 1) * (gate * torch.sigmoid(gate * self.swiglu_alpha))
        # The down bias is part of every rank's partial sum otherwise: rank 0 alone adds it.
        bias = self.down_proj_bias[expert] if self.tp_rank == 0 else None
        return self.project(activated, expert, 1, bias)


class GptOssMoE(nn.Module):
    """Router (with a bias) -> the top k logits -> softmax over those k -> weighted experts."""

    def __init__(self, config: Any, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.tp_size = tp_size
        self.router = ReplicatedLinear(
            config.hidden_size, config.num_local_experts, True, tp_rank, tp_size
        )
        self.experts = GptOssExperts(
            config.num_local_experts,
            config.hidden_size,
            config.intermediate_size,
            float(config.swiglu_limit),
            tp_rank,
            tp_size,
            float(getattr(config, "swiglu_alpha", DEFAULT_SWIGLU_ALPHA)),
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.router(hidden)
        top_logits, expert_ids = torch.topk(logits, self.top_k, dim=-1)
        weights = torch.softmax(top_logits, dim=-1)
        return all_reduce(self.experts(hidden, expert_ids, weights), self.tp_size)


class GptOssForCausalLM(DecoderForCausalLM):
    @staticmethod
    def decoder_spec(config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", True))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, attention_sinks=True)

    def build_model(self, hf_config: Any, tp_rank: int, tp_size: int) -> nn.Module:
        def make_mlp(layer_index: int) -> nn.Module:
            return GptOssMoE(hf_config, tp_rank, tp_size)

        return DecoderModel(hf_config, self.decoder_spec(hf_config), tp_rank, tp_size, make_mlp)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_checkpoint(self, self._per_expert(weights), self._is_unused)

    def _per_expert(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors under the names the shared loader places: sinks into the
        attention layer, MXFP4 pairs unpacked, stacked experts split per expert and part."""
        pending: dict[str, torch.Tensor] = {}  # an MXFP4 half waiting for its other half
        for name, tensor in weights:
            if name.endswith(".self_attn.sinks"):
                yield name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), tensor
                continue
            match = _EXPERTS_TENSOR.match(name)
            if match is None:
                yield name, tensor
                continue
            prefix, kind, suffix = match[1], match[2], match[3]
            if suffix:  # "_blocks" or "_scales": unpack once both halves are in
                other = f"{prefix}.{kind}{'_scales' if suffix == '_blocks' else '_blocks'}"
                if other not in pending:
                    pending[name] = tensor
                    continue
                blocks, scales = (
                    (tensor, pending.pop(other))
                    if suffix == "_blocks"
                    else (pending.pop(other), tensor)
                )
                # [experts, out, in]: gate/up rows interleaved, or down's [hidden, inter].
                stacked = dequantize_mxfp4(blocks, scales, torch.float32)
            else:  # dequantized: transformers' [experts, in, out]
                stacked = tensor.transpose(1, 2)
            yield from _split_experts(prefix, kind, stacked)
        if pending:
            raise ValueError(f"MXFP4 tensors without their other half: {sorted(pending)}")

    def checkpoint_names(self, param_name: str) -> list[str]:
        if param_name.endswith(".self_attn.attn.sinks"):
            return [param_name.replace(".self_attn.attn.sinks", ".self_attn.sinks")]
        for kind in ("gate_up_proj", "down_proj"):
            if param_name.endswith(f".mlp.experts.{kind}"):
                return [f"{param_name}_blocks", f"{param_name}_scales"]
        return default_checkpoint_names(param_name)


def _split_experts(
    prefix: str, kind: str, stacked: torch.Tensor
) -> Iterator[tuple[str, torch.Tensor]]:
    """A stacked [experts, out, in] matrix -> each expert's parts under per-expert names, which
    the shared loader places (and shards) as it does Qwen3-MoE's."""
    for expert in range(stacked.shape[0]):
        matrix = stacked[expert]
        if kind == "gate_up_proj":
            yield f"{prefix}.{expert}.gate_proj.weight", matrix[0::2]
            yield f"{prefix}.{expert}.up_proj.weight", matrix[1::2]
        else:
            yield f"{prefix}.{expert}.down_proj.weight", matrix
