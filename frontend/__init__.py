"""Frontends: the offline ``LLM`` API and (later) the HTTP server. Tokenize, detokenize, stream."""
