"""mistral: Magistral and Mistral's reasoning models (``--reasoning-parser mistral``).

Reasoning is between ``[THINK]`` and ``[/THINK]``; an output without ``[THINK]`` is all
content, and text before it stays content (vLLM's rules). The markers are special tokens in
Mistral's tokenizers, so they are decoded into the text.
"""

from __future__ import annotations

from conveyor.frontend.parsers.reasoning.base import ThinkTagsParser


class MistralParser(ThinkTagsParser):
    START = "[THINK]"
    END = "[/THINK]"
    opens_in_reasoning = False
    keeps_text_before_start = True
    needs_special_tokens = True
