"""deepseek_r1: DeepSeek-R1 and its distilled models (``--reasoning-parser deepseek_r1``).

``<think>`` (written by the model, or by newer templates into the prompt) ... ``</think>``,
then the answer. Without ``</think>`` the whole output is reasoning, as in vLLM.
"""

from __future__ import annotations

from conveyor.frontend.parsers.reasoning.base import ThinkTagsParser


class DeepSeekR1Parser(ThinkTagsParser):
    pass
