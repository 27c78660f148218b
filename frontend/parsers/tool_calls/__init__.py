"""Tool-call parsers, one file per format; ``--tool-call-parser NAME`` (vLLM's names).

Runs in the frontend process. Adding a format is one file with a ``ToolCallParser`` subclass
(see ``base.py``) and one line here; a parser's module is imported only when a server uses it.
"""

from __future__ import annotations

import importlib

from conveyor.frontend.parsers.tool_calls.base import ToolCall, ToolCallParser

# name -> (module in this package, class)
TOOL_CALL_PARSERS: dict[str, tuple[str, str]] = {
    "hermes": ("hermes", "HermesParser"),
    "llama3_json": ("llama3_json", "Llama3JsonParser"),
    "llama4_json": ("llama3_json", "Llama3JsonParser"),
    "openai": ("openai", "OpenAIParser"),
}


def tool_call_parser(name: str) -> ToolCallParser:
    """A new parser of format ``name`` (one of ``TOOL_CALL_PARSERS``)."""
    module, class_name = TOOL_CALL_PARSERS[name]
    cls = getattr(importlib.import_module(f"{__name__}.{module}"), class_name)
    return cls()


__all__ = ["TOOL_CALL_PARSERS", "ToolCall", "ToolCallParser", "tool_call_parser"]
