"""Speculative decoding in the worker: proposers, verification, and the step that uses them."""
