"""Which of our model classes serves each architecture named in config.json.

Runs in worker processes.
"""

from __future__ import annotations

from conveyor.worker.models.decoder import DecoderForCausalLM
from conveyor.worker.models.gemma3 import Gemma2ForCausalLM, Gemma3ForCausalLM
from conveyor.worker.models.gpt_oss import GptOssForCausalLM
from conveyor.worker.models.llama import LlamaForCausalLM, MistralForCausalLM
from conveyor.worker.models.mixtral import MixtralForCausalLM
from conveyor.worker.models.phi3 import Phi3ForCausalLM
from conveyor.worker.models.qwen2 import Qwen2ForCausalLM
from conveyor.worker.models.qwen3 import Qwen3ForCausalLM
from conveyor.worker.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES: dict[str, type[DecoderForCausalLM]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
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
