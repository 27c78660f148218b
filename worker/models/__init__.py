"""Our model implementations (Qwen3, Qwen2, Llama/Mistral) and the architecture registry.

Runs in worker processes.
"""

from worker.models.decoder import DecoderForCausalLM
from worker.models.llama import LlamaForCausalLM, MistralForCausalLM
from worker.models.qwen2 import Qwen2ForCausalLM
from worker.models.qwen3 import Qwen3ForCausalLM
from worker.models.registry import (
    UnsupportedArchitectureError,
    model_class_for,
    supported_architectures,
)

__all__ = [
    "DecoderForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "UnsupportedArchitectureError",
    "model_class_for",
    "supported_architectures",
]
