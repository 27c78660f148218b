"""Reasoning parsers, one file per format; ``--reasoning-parser NAME`` (vLLM's names).

Runs in the frontend process. Adding a format is one file with a ``ReasoningParser`` subclass
(see ``base.py``) and one line here; a parser's module is imported only when a server uses it.
"""

from __future__ import annotations

import importlib
from typing import Any

from conveyor.frontend.parsers.reasoning.base import ReasoningParser

# name -> (module in this package, class)
REASONING_PARSERS: dict[str, tuple[str, str]] = {
    "qwen3": ("qwen3", "Qwen3Parser"),
    "deepseek_r1": ("deepseek_r1", "DeepSeekR1Parser"),
    "deepseek_v3": ("deepseek_v3", "DeepSeekV3Parser"),
    "openai_gptoss": ("gpt_oss", "GptOssParser"),
    "gpt_oss": ("gpt_oss", "GptOssParser"),
    "mistral": ("mistral", "MistralParser"),
    "granite": ("granite", "GraniteParser"),
}


def reasoning_parser(
    name: str, template_kwargs: dict[str, Any] | None, prompt_text: str
) -> ReasoningParser:
    """A parser of format ``name`` for one request (its template variables and prompt)."""
    module, class_name = REASONING_PARSERS[name]
    cls = getattr(importlib.import_module(f"{__name__}.{module}"), class_name)
    return cls(template_kwargs, prompt_text)


def history_fields(name: str | None, reasoning: str) -> dict[str, str]:
    """An earlier answer's reasoning as format ``name``'s template reads it (no parser: vLLM's
    two names)."""
    if name is None:
        return {"reasoning": reasoning, "reasoning_content": reasoning}
    module, class_name = REASONING_PARSERS[name]
    cls = getattr(importlib.import_module(f"{__name__}.{module}"), class_name)
    return cls.history_fields(reasoning)


__all__ = ["REASONING_PARSERS", "ReasoningParser", "history_fields", "reasoning_parser"]
