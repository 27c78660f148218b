"""qwen3: Qwen3 and QwQ (``--reasoning-parser qwen3``).

The answer starts with ``<think>`` (older templates) or inside the reasoning (newer ones write
``<think>`` into the prompt), and ``</think>`` ends it. With ``enable_thinking: false`` the
template closes the reasoning in the prompt, so the whole output is content; with thinking on,
an output that never writes ``</think>`` is all reasoning (it was cut off), as in vLLM.
"""

from __future__ import annotations

from conveyor.frontend.parsers.reasoning.base import ThinkTagsParser


class Qwen3Parser(ThinkTagsParser):
    def reasoning_ended(self, prompt_text: str) -> bool:
        if self.template_kwargs.get("enable_thinking") is False:
            return True
        return super().reasoning_ended(prompt_text)
