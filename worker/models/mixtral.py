"""Mixtral (``MixtralForCausalLM``, 8x7B, 8x22B): Mistral's attention, every MLP sparse.

Runs in worker processes. Attention is Mistral's (no biases, no q/k norm; ``sliding_window``,
null in the released models, is read by the decoder). Every layer's MLP is a mixture of
``num_local_experts`` SwiGLU experts of width ``intermediate_size``, ``num_experts_per_tok`` (2)
per token (worker/layers/fused_moe.py). The checkpoint calls the block ``block_sparse_moe`` and
an expert's gate, down and up projections ``w1``, ``w2``, ``w3``. transformers always renormalises
the top-k routing weights and keeps them in float32 while they scale the experts' outputs.
``router_jitter_noise`` is training-only.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from conveyor.worker.layers.fused_moe import FusedMoE
from conveyor.worker.models.checkpoint import MIXTRAL_EXPERTS, checkpoint_names
from conveyor.worker.models.decoder import DecoderForCausalLM, DecoderModel, DecoderSpec


class MixtralForCausalLM(DecoderForCausalLM):
    @staticmethod
    def decoder_spec(config: Any) -> DecoderSpec:
        return DecoderSpec()  # no biases, no q/k norm

    def build_model(self, hf_config: Any, tp_rank: int, tp_size: int) -> nn.Module:
        if hf_config.hidden_act != "silu":
            raise ValueError(f"hidden_act {hf_config.hidden_act!r} is not supported (only silu)")

        def make_mlp(layer_index: int) -> nn.Module:
            return FusedMoE(
                hf_config.num_local_experts,
                hf_config.num_experts_per_tok,
                hf_config.hidden_size,
                hf_config.intermediate_size,
                renormalize=True,
                weights_in_hidden_dtype=False,
                tp_rank=tp_rank,
                tp_size=tp_size,
            )

        spec = self.decoder_spec(hf_config)
        return DecoderModel(hf_config, spec, tp_rank, tp_size, make_mlp)

    def checkpoint_names(self, param_name: str) -> list[str]:
        return checkpoint_names(param_name, MIXTRAL_EXPERTS, self.config.num_local_experts)
