"""Tool calling's public names, for callers that import them from here: the parsers themselves
live in ``frontend/parsers/tool_calls/`` (one file per format, a registry in its
``__init__``), the forced formats of ``required`` and a named function in ``forced.py`` there,
and the streamed split in ``stream.py``.

Runs in the frontend process.
"""

from __future__ import annotations

from conveyor.frontend.parsers.tool_calls import TOOL_CALL_PARSERS, tool_call_parser
from conveyor.frontend.parsers.tool_calls.base import CallDraft, Scan, ToolCall, ToolCallParser
from conveyor.frontend.parsers.tool_calls.forced import (
    NamedCallParser,
    RequiredCallsParser,
    forced_schema,
)
from conveyor.frontend.parsers.tool_calls.stream import CallDelta, ToolCallStream

__all__ = [
    "TOOL_CALL_PARSERS",
    "CallDelta",
    "CallDraft",
    "NamedCallParser",
    "RequiredCallsParser",
    "Scan",
    "ToolCall",
    "ToolCallParser",
    "ToolCallStream",
    "forced_schema",
    "tool_call_parser",
]
