"""Checks on a prompt before it reaches the engine, with messages a user can act on.

Runs in the frontend process. The engine re-checks what it must (it never trusts the wire), but
catching bad input here gives the caller a ValueError naming the prompt, and nothing reaches the
engine, so one bad prompt in a batch cannot leave half the batch submitted.
"""

from __future__ import annotations


def find_prompt_problem(
    prompt_token_ids: list[int], vocab_size: int, max_model_len: int
) -> str | None:
    """A human-readable reason the prompt cannot run, or None if it can."""
    if not prompt_token_ids:
        return "the prompt is empty"
    if not all(isinstance(t, int) for t in prompt_token_ids):
        return "prompt token ids must be integers"
    low, high = min(prompt_token_ids), max(prompt_token_ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        return f"token id {bad} is outside the vocabulary [0, {vocab_size})"
    if len(prompt_token_ids) >= max_model_len:
        return (
            f"the prompt has {len(prompt_token_ids)} tokens, but max_model_len is "
            f"{max_model_len} (the prompt must leave room for at least one generated token)"
        )
    return None
