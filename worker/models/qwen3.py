"""Qwen3 (dense): the Llama block with an RMSNorm on every query and key head.

Runs in worker processes. The per-head q/k norms come before RoPE and keep attention logits in
range without a bias; the projections have none (``attention_bias`` is false in every released
Qwen3). Small Qwen3 models tie the LM head to the embedding.
"""

from __future__ import annotations

from typing import Any

from conveyor.worker.models.decoder import DecoderForCausalLM, DecoderSpec


class Qwen3ForCausalLM(DecoderForCausalLM):
    @staticmethod
    def decoder_spec(config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, qk_norm=True)
