"""Parsers of what a model writes: its reasoning (``reasoning/``) and its tool calls
(``tool_calls/``), each a registry of one small file per model family's format.

Runs in the frontend process. ``output_split.py`` runs both over a choice's text, whole or as
it streams.
"""
