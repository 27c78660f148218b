"""Phi-3, Phi-3.5 and Phi-4-mini (``Phi3ForCausalLM``): the Llama block under other tensor names.

Runs in worker processes. The checkpoint already fuses the projections we fuse: one
``self_attn.qkv_proj`` ([q; k; v] rows) and one ``mlp.gate_up_proj`` ([gate; up]); the linear
layers split such a tensor into its parts, so tensor parallelism slices each part as usual.
Differences transformers applies and we follow:

- ``sliding_window`` (Phi-3-mini-4k: 2047) windows every layer, as for Mistral; the decoder reads
  it from the config.
- ``partial_rotary_factor`` (Phi-4-mini: 0.75) rotates only the leading part of each head.
- ``longrope`` (the 128k variants, Phi-3.5, Phi-4-mini) is served within the original context
  (see worker/layers/rotary.py); the engine caps max_model_len there.
- The dropouts (``resid_pdrop``, ``embd_pdrop``, ``attention_dropout``) are training-only.
"""

from __future__ import annotations

from typing import Any

from conveyor.worker.models.decoder import DecoderForCausalLM, DecoderSpec


class Phi3ForCausalLM(DecoderForCausalLM):
    @staticmethod
    def decoder_spec(config: Any) -> DecoderSpec:
        return DecoderSpec()  # no biases, no q/k norm

    def checkpoint_names(self, param_name: str) -> list[str]:
        # The checkpoint names our fused parameters as we do, not by their parts.
        return [param_name]
