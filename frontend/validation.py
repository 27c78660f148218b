"""Checks on a prompt before it reaches the engine, with messages a user can act on.

Runs in the frontend process. The engine re-checks what it must (it never trusts the wire), but
catching bad input here gives the caller a ValueError naming the prompt, and nothing reaches the
engine, so one bad prompt in a batch cannot leave half the batch submitted.
"""

from __future__ import annotations

from protocol import CacheConfig, EngineConfig


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


def context_limit(config: EngineConfig) -> int:
    """The most tokens (prompt + output) one request may hold: the engine's scheduler may be
    configured below the model's own limit, and the engine enforces the scheduler's."""
    return min(config.model.max_model_len, config.scheduler.max_model_len)


def find_kv_cache_problem(
    num_prompt_tokens: int, max_tokens: int | None, cache: CacheConfig
) -> str | None:
    """A reason the request can never fit the engine's whole KV pool, or None.

    Counts prompt + max_tokens, as a policy that reserves every output's block at admission
    does. ``max_tokens=None`` (until the context is full) is checked for its prompt and first
    token only: it may end (EOS) long before the context is full. An engine that did not say how
    many blocks it has (``num_blocks`` None) is left to decide on its own.
    """
    if cache.num_blocks is None:
        return None
    num_tokens = num_prompt_tokens + (1 if max_tokens is None else max_tokens)
    num_needed = -(-num_tokens // cache.block_size)
    num_usable = cache.num_blocks - 1  # block 0 is the engine's reserved null block
    if num_needed <= num_usable:
        return None
    output = "its first output token" if max_tokens is None else f"max_tokens={max_tokens}"
    return (
        f"the prompt ({num_prompt_tokens} tokens) and {output} need {num_needed} KV cache blocks "
        f"of {cache.block_size} tokens, but the server's whole KV cache holds {num_usable} "
        f"({num_usable * cache.block_size} tokens); shorten the prompt or lower max_tokens"
    )
