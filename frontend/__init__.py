"""Frontends: the offline ``LLM`` API, the engine clients and the OpenAI-compatible HTTP server
(``conveyor frontend``). Tokenize, detokenize, stream."""

from frontend.engine_args import EngineArgs
from frontend.llm import LLM
from frontend.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "CompletionOutput", "EngineArgs", "RequestOutput"]
