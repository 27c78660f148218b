"""Prompt logprobs: each prompt token's log-probability given the tokens before it, with the most
likely alternatives, from the forward passes that prefill the prompt.

Runs in worker processes. A prompt chunk's forward pass computes hidden states for every token
it holds, but only the sampling rows usually reach the LM head; a request that asked for prompt
logprobs also sends the rows of its chunk's positions there (``PromptLogprobsPlan``): position q
predicts prompt token q + 1. The rows are kept in the request's ``RequestState`` across chunks
(and across a preemption: positions already recorded are not recorded again) and leave with the
request's first sampled token, when its prompt is complete. The engine never lets such a
request read a prefix-cache hit, so every position is computed. Rows are the raw model
distribution's (no temperature, penalties or masks), as vLLM's are, in float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from conveyor.protocol import Logprobs
from conveyor.worker.input_batch import InputBatch, RequestState

# Rows pushed through the LM head and log_softmax at once: a prompt chunk of 2,048 tokens over a
# 150k vocabulary would otherwise hold 1.2 GB of float32 logits.
_ROWS_PER_PASS = 256


@dataclass
class PromptLogprobsPlan:
    """Which flat-stream rows of this step feed prompt logprobs, and for whom."""

    # Flat-stream index of each position, and the prompt token it predicts.
    indices: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    # Per request with rows this step: its state and how many rows are its own, in order.
    owners: list[tuple[RequestState, int]] = field(default_factory=list)


def plan_prompt_logprobs(
    batch: InputBatch, rows: np.ndarray, query_start_loc: np.ndarray
) -> PromptLogprobsPlan | None:
    """The rows of this step's prompt positions whose logprobs are not yet recorded; None when
    no scheduled request wants any (the common case: one attribute read per request)."""
    plan = None
    for i, row in enumerate(rows.tolist()):
        state = batch.row_states[row]
        if state.sampling_params.prompt_logprobs is None or state.prompt_logprobs_sent:
            continue
        start = int(batch.num_computed_tokens[row])
        end = start + int(batch.num_scheduled_tokens[row])
        # Position q predicts token q + 1; the last prompt position predicts the first output.
        first, last = (
            max(start, len(state.prompt_logprob_rows)),
            min(end, state.num_prompt_tokens - 1),
        )
        if first >= last:
            continue
        plan = plan or PromptLogprobsPlan()
        base = int(query_start_loc[i]) - start
        plan.indices.extend(range(base + first, base + last))
        plan.targets.extend(batch.token_ids[row, first + 1 : last + 1].tolist())
        plan.owners.append((state, last - first))
    return plan


def record_prompt_logprobs(
    plan: PromptLogprobsPlan,
    hidden: torch.Tensor,
    compute_logits,
    vocab_size: int,
) -> None:
    """Push ``hidden`` (the plan's rows, in order) through the LM head and append each row's
    (token, top alternatives) to its request's state."""
    targets = torch.tensor(plan.targets, dtype=torch.int64, device=hidden.device)
    num_top = max(state.sampling_params.prompt_logprobs or 0 for state, _ in plan.owners)
    token_ids: list[list[int]] = []
    values: list[list[float]] = []
    ranks: list[int] = []
    for start in range(0, len(plan.targets), _ROWS_PER_PASS):
        stop = start + _ROWS_PER_PASS
        logits = compute_logits(hidden[start:stop])[:, :vocab_size]
        logprobs = torch.log_softmax(logits, dim=-1)
        wanted = targets[start:stop].unsqueeze(-1)
        actual = logprobs.gather(-1, wanted)
        ranks += ((logprobs > actual).sum(dim=-1) + 1).tolist()
        top_values, top_ids = logprobs.topk(num_top, dim=-1)
        token_ids += torch.cat([wanted, top_ids], dim=-1).tolist()
        values += torch.cat([actual, top_values], dim=-1).tolist()
    at = 0
    for state, count in plan.owners:
        keep = 1 + (state.sampling_params.prompt_logprobs or 0)
        for j in range(at, at + count):
            state.prompt_logprob_rows.append((token_ids[j][:keep], values[j][:keep], ranks[j]))
        at += count


def take_prompt_logprobs(state: RequestState) -> Logprobs:
    """The request's recorded rows, to send with its first token; it records no more."""
    rows = state.prompt_logprob_rows
    state.prompt_logprobs_sent = True
    state.prompt_logprob_rows = []
    return Logprobs(
        token_ids=[ids for ids, _, _ in rows],
        logprobs=[values for _, values, _ in rows],
        ranks=[rank for _, _, rank in rows],
    )
