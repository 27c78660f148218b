"""OpenAI's harmony format (gpt-oss), as the decoded text of an answer: messages on channels.

Runs in the frontend process. After the generation prompt ``<|start|>assistant`` a gpt-oss
model writes messages, each a header and a body::

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>final<|message|>the answer
    <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": ...}

``analysis`` is the reasoning, ``final`` the content, and a message to ``functions.NAME`` (the
recipient may stand before or after the channel) a tool call whose body is its arguments. The
tokens in ``<|...|>`` are special tokens: the text is decoded with them. ``<|return|>`` and
``<|call|>`` end the generation (stop tokens, so not in the text).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from conveyor.frontend.parsers.tool_calls.json_text import partial_overlap

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
ENDINGS = (END, "<|call|>", "<|return|>")
_ENDING = re.compile("|".join(re.escape(e) for e in ENDINGS))
_RECIPIENT = re.compile(r"to=(\S+?)(?=<\||\s|$)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


@dataclass
class HarmonyMessage:
    channel: str | None
    recipient: str | None
    body: str
    ended: bool  # its end marker was written (or the output ended after it)


def read_messages(text: str, done: bool) -> list[HarmonyMessage]:
    """The messages of ``text``; a body still being written holds back what may be the start of
    a marker. A header not yet whole is not listed."""
    messages: list[HarmonyMessage] = []
    position = 0
    while position < len(text):
        header_end = text.find(MESSAGE, position)
        if header_end < 0:
            break
        header = text[position:header_end]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        body_start = header_end + len(MESSAGE)
        ending = _ENDING.search(text, body_start)
        if ending is None:
            keep = 0 if done else max(partial_overlap(text, marker) for marker in (*ENDINGS, START))
            body = text[body_start : max(body_start, len(text) - keep)]
            messages.append(_message(channel, recipient, body, done))
            break
        messages.append(_message(channel, recipient, text[body_start : ending.start()], True))
        position = ending.end()
        if text.startswith(START, position):
            position += len(START)
    return messages


def _message(
    channel: re.Match[str] | None, recipient: re.Match[str] | None, body: str, ended: bool
) -> HarmonyMessage:
    return HarmonyMessage(
        channel.group(1) if channel else None,
        recipient.group(1) if recipient else None,
        body,
        ended,
    )


def is_reasoning(message: HarmonyMessage) -> bool:
    return message.channel == "analysis" and message.recipient is None


def is_call(message: HarmonyMessage) -> bool:
    return message.recipient is not None and message.recipient.startswith("functions.")


def reasoning_and_content(messages: list[HarmonyMessage]) -> tuple[str, str]:
    """The analysis messages' text (one per line) and the final (and commentary) text."""
    reasoning = "\n".join(m.body for m in messages if is_reasoning(m))
    content = "".join(m.body for m in messages if not is_reasoning(m) and not is_call(m))
    return reasoning, content
