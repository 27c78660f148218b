"""Qwen3-MoE (``Qwen3MoeForCausalLM``, e.g. Qwen3-30B-A3B): Qwen3's attention, sparse MLPs.

Runs in worker processes. Attention is Qwen3's (an RMSNorm on every query and key head). The MLP
of most layers is a mixture of ``num_experts`` SwiGLU experts of width ``moe_intermediate_size``,
``num_experts_per_tok`` of them per token (worker/layers/fused_moe.py); a layer listed in
``mlp_only_layers``, or off the ``decoder_sparse_step`` grid, keeps a dense MLP of width
``intermediate_size``, as transformers decides. The top-k routing weights are renormalised only
when ``norm_topk_prob`` is set (it is in the released models), and rounded to the model's dtype
before they scale the experts' outputs.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from conveyor.worker.layers.fused_moe import FusedMoE
from conveyor.worker.models.checkpoint import QWEN_MOE_EXPERTS, checkpoint_names
from conveyor.worker.models.decoder import DecoderModel
from conveyor.worker.models.qwen3 import Qwen3ForCausalLM


def is_sparse_layer(config: Any, layer_index: int) -> bool:
    """Whether a layer's MLP is the mixture of experts (transformers' rule)."""
    return (
        layer_index not in (config.mlp_only_layers or [])
        and config.num_experts > 0
        and (layer_index + 1) % config.decoder_sparse_step == 0
    )


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def build_model(self, hf_config: Any, tp_rank: int, tp_size: int) -> nn.Module:
        if hf_config.hidden_act != "silu":
            raise ValueError(f"hidden_act {hf_config.hidden_act!r} is not supported (only silu)")

        def make_mlp(layer_index: int) -> nn.Module | None:
            if not is_sparse_layer(hf_config, layer_index):
                return None  # the dense MLP
            return FusedMoE(
                hf_config.num_experts,
                hf_config.num_experts_per_tok,
                hf_config.hidden_size,
                hf_config.moe_intermediate_size,
                renormalize=bool(hf_config.norm_topk_prob),
                weights_in_hidden_dtype=True,
                tp_rank=tp_rank,
                tp_size=tp_size,
            )

        spec = self.decoder_spec(hf_config)
        return DecoderModel(hf_config, spec, tp_rank, tp_size, make_mlp)

    def checkpoint_names(self, param_name: str) -> list[str]:
        return checkpoint_names(param_name, QWEN_MOE_EXPERTS, self.config.num_experts)
