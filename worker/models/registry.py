"""Which of our model classes serves each architecture named in config.json.

Runs in worker processes.
"""

from __future__ import annotations

from worker.models.decoder import DecoderForCausalLM
from worker.models.llama import LlamaForCausalLM, MistralForCausalLM
from worker.models.qwen2 import Qwen2ForCausalLM
from worker.models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[DecoderForCausalLM]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
}


class UnsupportedArchitectureError(ValueError):
    """config.json names an architecture we have no model class for."""


def supported_architectures() -> list[str]:
    return sorted(MODEL_CLASSES)


def model_class_for(architecture: str) -> type[DecoderForCausalLM]:
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported; supported: "
            f"{', '.join(supported_architectures())}"
        ) from None
