"""Our model implementations (Qwen3, Qwen2, Llama/Mistral, Phi-3, Gemma 3, Qwen3-MoE, Mixtral)
and the architecture registry.

Runs in worker processes.
"""

from conveyor.worker.models.decoder import DecoderForCausalLM
from conveyor.worker.models.gemma3 import Gemma3ForCausalLM
from conveyor.worker.models.llama import LlamaForCausalLM, MistralForCausalLM
from conveyor.worker.models.mixtral import MixtralForCausalLM
from conveyor.worker.models.phi3 import Phi3ForCausalLM
from conveyor.worker.models.qwen2 import Qwen2ForCausalLM
from conveyor.worker.models.qwen3 import Qwen3ForCausalLM
from conveyor.worker.models.qwen3_moe import Qwen3MoeForCausalLM
from conveyor.worker.models.registry import (
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
