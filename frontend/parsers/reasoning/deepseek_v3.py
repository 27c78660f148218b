"""deepseek_v3: DeepSeek-V3.1 and later hybrid models (``--reasoning-parser deepseek_v3``).

They think only when the request asks (``chat_template_kwargs`` ``thinking`` or
``enable_thinking`` true, as vLLM reads them): then as DeepSeek-R1, else the whole output is
content.
"""

from __future__ import annotations

from conveyor.frontend.parsers.reasoning.base import ThinkTagsParser


class DeepSeekV3Parser(ThinkTagsParser):
    def reasoning_ended(self, prompt_text: str) -> bool:
        kwargs = self.template_kwargs
        thinking = bool(kwargs.get("thinking")) or bool(kwargs.get("enable_thinking"))
        return not thinking or super().reasoning_ended(prompt_text)
