"""Frontends: the offline ``LLM`` API, the engine clients and the OpenAI-compatible HTTP server
(``conveyor frontend``). Tokenize, detokenize, stream."""

from conveyor.frontend.engine_args import EngineArgs
from conveyor.frontend.llm import LLM
from conveyor.frontend.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "CompletionOutput", "EngineArgs", "RequestOutput"]
