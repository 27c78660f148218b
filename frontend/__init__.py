"""Frontends: the offline ``LLM`` API and (later) the HTTP server. Tokenize, detokenize, stream."""

from frontend.engine_args import EngineArgs
from frontend.llm import LLM
from frontend.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "CompletionOutput", "EngineArgs", "RequestOutput"]
