"""glm45: GLM-4.5/4.6's calls (``--tool-call-parser glm45``)::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

Values become JSON by the types the tool declares (strings stay text), as vLLM converts them;
an argument goes out in a stream once its value is closed. Content is the text before the first
call.
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
_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_NAME_END = re.compile(r"\n|<arg_key>")


class Glm45Parser(ToolCallParser):
    needs_special_tokens = True

    def scan(self, text: str, done: bool) -> Scan:
        return tagged_calls(text, done, CALL, CALL, CALL_END, self._call)

    def _call(self, body: str, closed: bool) -> CallDraft | None:
        name_end = _NAME_END.search(body)
        if name_end is None:
            if not closed:
                return None
            name_end_at = len(body)
        else:
            name_end_at = name_end.start()
        name = body[:name_end_at].strip()
        if not name:
            return None
        members = []
        for argument in _ARGUMENT.finditer(body, name_end_at):
            key = argument.group(1).strip()
            value = text_value(argument.group(2), self.parameter_type(name, key))
            member = encode({key: value})
            if member is None:
                return CallDraft(name)
            members.append(member[1:-1])
        arguments = "{" + ", ".join(members) + ("}" if closed else "")
        return CallDraft(name, arguments, closed)
