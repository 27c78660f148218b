"""Qwen2 and Qwen2.5: the Llama block with a bias on the q, k and v projections.

Runs in worker processes. The output projection has no bias. Qwen2.5's 128K context comes from
YaRN RoPE scaling in config.json, which the rotary layer handles.
"""

from __future__ import annotations

from typing import Any

from conveyor.worker.models.decoder import DecoderForCausalLM, DecoderSpec


class Qwen2ForCausalLM(DecoderForCausalLM):
    @staticmethod
    def decoder_spec(config: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=True)
