"""conveyor: an LLM serving engine with an OpenAI-compatible API.

    from conveyor import LLM, SamplingParams

    llm = LLM()                      # the embedded default model; or LLM("path/or/hf-id")
    for output in llm.generate(["def main():"], SamplingParams(max_tokens=32)):
        print(output.outputs[0].text)

The repository's top-level folders install as this package's subpackages: ``conveyor.protocol``,
``conveyor.runtime``, ``conveyor.engine_core``, ``conveyor.executor``, ``conveyor.worker``,
``conveyor.frontend``, ``conveyor.entrypoints`` and ``conveyor.bench`` (see docs/architecture.md).

Runs in whichever process imports it. The names below are loaded on first use: an engine-core or
worker process imports ``conveyor.engine_core`` or ``conveyor.worker`` through this package, and
must not pay for the offline API (nor the engine core for torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from conveyor.frontend.engine_args import EngineArgs
    from conveyor.frontend.llm import LLM
    from conveyor.frontend.outputs import CompletionOutput, RequestOutput
    from conveyor.protocol.lora import LoRARequest
    from conveyor.protocol.sampling_params import SamplingParams

_EXPORTS = {
    "LLM": "conveyor.frontend.llm",
    "SamplingParams": "conveyor.protocol.sampling_params",
    "EngineArgs": "conveyor.frontend.engine_args",
    "RequestOutput": "conveyor.frontend.outputs",
    "CompletionOutput": "conveyor.frontend.outputs",
    "LoRARequest": "conveyor.protocol.lora",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
