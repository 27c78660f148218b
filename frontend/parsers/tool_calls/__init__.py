"""Tool-call parsers, one file per format; ``--tool-call-parser NAME`` (vLLM's names).

Runs in the frontend process. Adding a format is one file with a ``ToolCallParser`` subclass
(see ``base.py``) and one line here; a parser's module is imported only when a server uses it.
"""

from __future__ import annotations

import importlib
from typing import Any

from conveyor.frontend.parsers.tool_calls.base import ToolCall, ToolCallParser

# name -> (module in this package, class)
TOOL_CALL_PARSERS: dict[str, tuple[str, str]] = {
    "hermes": ("hermes", "HermesParser"),
    "llama3_json": ("llama3_json", "Llama3JsonParser"),
    "llama4_json": ("llama3_json", "Llama3JsonParser"),
    "openai": ("openai", "OpenAIParser"),
    "gpt_oss": ("openai", "OpenAIParser"),
    "mistral": ("mistral", "MistralParser"),
    "pythonic": ("pythonic", "PythonicParser"),
    "llama4_pythonic": ("pythonic", "PythonicParser"),
    "qwen3_coder": ("qwen3_coder", "Qwen3CoderParser"),
    "qwen3_xml": ("qwen3_coder", "Qwen3CoderParser"),
    "deepseek_v3": ("deepseek_v3", "DeepSeekV3Parser"),
    "deepseek_v31": ("deepseek_v3", "DeepSeekV31Parser"),
    "granite": ("granite", "GraniteParser"),
    "kimi_k2": ("kimi_k2", "KimiK2Parser"),
    "glm45": ("glm45", "Glm45Parser"),
    "internlm": ("internlm", "InternLMParser"),
}


def tool_call_parser(name: str, tools: list[dict[str, Any]] | None = None) -> ToolCallParser:
    """A new parser of format ``name`` (one of ``TOOL_CALL_PARSERS``) for a request's
    ``tools``."""
    module, class_name = TOOL_CALL_PARSERS[name]
    cls = getattr(importlib.import_module(f"{__name__}.{module}"), class_name)
    return cls(tools)


__all__ = ["TOOL_CALL_PARSERS", "ToolCall", "ToolCallParser", "tool_call_parser"]
