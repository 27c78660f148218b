"""qwen3_coder: Qwen3-Coder's XML calls (``--tool-call-parser qwen3_coder``, also
``qwen3_xml``)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's text becomes a JSON value by the type the tool declares for it (strings stay
text, other types are read as JSON where they read), as vLLM converts them; a parameter goes
out in a stream once its closing tag is written. Content is the text before the first call.
"""

from __future__ import annotations

import re

from conveyor.frontend.parsers.tool_calls.base import (
    CallDraft,
    Scan,
    ToolCallParser,
    tagged_calls,
    text_value,
)
from conveyor.frontend.parsers.tool_calls.json_text import encode

CALL, CALL_END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
FUNCTION_END = "</function>"


class Qwen3CoderParser(ToolCallParser):
    def scan(self, text: str, done: bool) -> Scan:
        return tagged_calls(text, done, CALL, CALL, CALL_END, self._call)

    def _call(self, body: str, closed: bool) -> CallDraft | None:
        function = _FUNCTION.search(body)
        if function is None:
            return None
        name = function.group(1).strip()
        members = []
        for parameter in _PARAMETER.finditer(body, function.end()):
            key = parameter.group(1).strip()
            value = text_value(_unwrap(parameter.group(2)), self.parameter_type(name, key))
            member = encode({key: value})
            if member is None:
                return CallDraft(name)
            members.append(member[1:-1])
        ended = FUNCTION_END in body[function.end() :]
        arguments = "{" + ", ".join(members) + ("}" if ended or closed else "")
        return CallDraft(name, arguments, closed and ended)


def _unwrap(value: str) -> str:
    """A parameter's text without the newline after its opening tag and before its closing one."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value
