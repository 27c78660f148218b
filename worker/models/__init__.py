"""Our model implementations (Qwen3, Qwen2, Llama/Mistral, Phi-3, Gemma 3, Qwen3-MoE, Mixtral)
and the architecture registry.

Runs in worker processes.
"""

from worker.models.decoder import DecoderForCausalLM
from worker.models.gemma3 import Gemma3ForCausalLM
from worker.models.llama import LlamaForCausalLM, MistralForCausalLM
from worker.models.mixtral import MixtralForCausalLM
from worker.models.phi3 import Phi3ForCausalLM
from worker.models.qwen2 import Qwen2ForCausalLM
from worker.models.qwen3 import Qwen3ForCausalLM
from worker.models.qwen3_moe import Qwen3MoeForCausalLM
from worker.models.registry import (
    UnsupportedArchitectureError,
    model_class_for,
    supported_architectures,
)

__all__ = [
    "DecoderForCausalLM",
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "UnsupportedArchitectureError",
    "model_class_for",
    "supported_architectures",
]
