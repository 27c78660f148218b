"""Llama (1, 2, 3.x) and Mistral: the plain pre-norm SwiGLU decoder.

Runs in worker processes. Biases are off unless config.json says ``attention_bias`` /
``mlp_bias``; ``head_dim`` is read from the config when present (Mistral-Nemo's is not
hidden_size / num_heads). Llama 3.1's long context is the "llama3" RoPE scaling.
"""

from __future__ import annotations

from typing import Any

from conveyor.worker.models.decoder import DecoderForCausalLM, DecoderSpec


class LlamaForCausalLM(DecoderForCausalLM):
    @staticmethod
    def decoder_spec(config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec(
            qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False))
        )


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral 7B v0.1 windows every layer at 4096 tokens (``sliding_window``); later versions
    set it to null. The decoder reads the window from the config, as for every family."""
