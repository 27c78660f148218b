"""Verification of draft tokens against the target model's distribution at every position.

Runs in worker processes. A request with drafts ``d_1 .. d_k`` had all ``1 + k`` positions
scored in one forward pass: position j's logits give the target's distribution ``p_j`` of the
token after it. The drafts are checked in order:

* greedy rows accept ``d_{j+1}`` while it is ``argmax p_j``, then take ``argmax p_a`` at the first
  mismatch (or after the last draft): exactly the tokens greedy decoding would have made;
* random rows use rejection sampling with the proposer's distribution ``q``: ``d_{j+1}`` is
  accepted with probability ``min(1, p_j(d) / q_j(d))``; at the first rejection the token comes
  from ``max(0, p_j - q_j)`` renormalised, and after k acceptances from ``p_k``. Each emitted
  token is then distributed exactly as ``p`` (Leviathan et al. 2023; Chen et al. 2023). A draft
  model's drafts were sampled from its own ``q`` (passed in per row); an n-gram draft is a point
  mass (``q(d) = 1``), so it is accepted with probability ``p_j(d)`` and a rejection draws from
  ``p_j`` with ``d`` removed.

``p_j`` is the distribution the sampler would draw from: the row's constraints (allow-lists,
biases, the ``min_tokens`` ban), penalties, temperature and filters, applied at each position as
if the drafts before it had been emitted. Seeded rows draw every uniform from their own
generator, so a seeded request repeats its tokens whenever its steps repeat.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.worker.sampler import (
    apply_penalties,
    apply_token_constraints,
    gather_logprobs,
    random_probs,
)
from conveyor.worker.sampling_metadata import SamplingMetadata


@dataclass
class Verified:
    # Per row: the accepted drafts, then the token after them (1 .. k + 1 tokens).
    token_ids: list[list[int]]
    # Per row, when any row asked for logprobs: one (token ids, logprobs, rank) per token, the
    # emitted token first then the top alternatives under the raw logits; [] for rows that
    # did not ask.
    logprob_rows: list[list[tuple[list[int], list[float], int]]] | None = None


def verify(
    logits: torch.Tensor,
    drafts: list[list[int]],
    metadata: SamplingMetadata,
    is_random: list[bool],
    generators: list[torch.Generator | None],
    logprob_counts: list[int | None],
    draft_q: list[torch.Tensor | None] | None = None,
) -> Verified:
    """Check each row's drafts; ``logits`` is [sum(1 + k_i), V], row i's positions together,
    ``metadata`` one row per position (built as if the drafts before it were emitted);
    ``draft_q[i]`` ([k_i, V]) the distributions row i's drafts were sampled from (None: point
    masses)."""
    logits = logits.float()
    raw_logprobs = None
    if metadata.max_num_logprobs is not None:
        raw_logprobs = torch.log_softmax(logits, dim=-1)
    if metadata.token_constraints is not None:
        logits = apply_token_constraints(logits, metadata.token_constraints)
    logits = apply_penalties(logits, metadata)
    greedy = logits.argmax(dim=-1).tolist()
    probs = None if metadata.all_greedy else random_probs(logits, metadata)
    starts = [0]
    for row_drafts in drafts:
        starts.append(starts[-1] + len(row_drafts) + 1)
    draft_probs = _draft_probs(probs, drafts, starts, is_random)
    token_ids = []
    for i, row_drafts in enumerate(drafts):
        start = starts[i]
        if is_random[i]:
            assert probs is not None
            q = None if draft_q is None else draft_q[i]
            tokens = _verify_random(probs, start, row_drafts, draft_probs[i], generators[i], q)
        else:
            num_accepted = 0
            while (
                num_accepted < len(row_drafts)
                and row_drafts[num_accepted] == greedy[start + num_accepted]
            ):
                num_accepted += 1
            tokens = row_drafts[:num_accepted] + [greedy[start + num_accepted]]
        token_ids.append(tokens)
    verified = Verified(token_ids)
    if raw_logprobs is not None:
        verified.logprob_rows = _logprob_rows(
            raw_logprobs, token_ids, starts, logprob_counts, metadata.max_num_logprobs
        )
    return verified


def _draft_probs(
    probs: torch.Tensor | None, drafts: list[list[int]], starts: list[int], is_random: list[bool]
) -> list[list[float]]:
    """Per random row, the target's probability of each draft at the position before it (one
    gather and one copy to the host for the whole step)."""
    positions, token_ids = [], []
    for i, row_drafts in enumerate(drafts):
        if is_random[i]:
            positions += range(starts[i], starts[i] + len(row_drafts))
            token_ids += row_drafts
    if probs is None or not positions:
        return [[] for _ in drafts]
    index = torch.tensor(positions, device=probs.device)
    values = probs[index, torch.tensor(token_ids, device=probs.device)].tolist()
    out, offset = [], 0
    for i, row_drafts in enumerate(drafts):
        count = len(row_drafts) if is_random[i] else 0
        out.append(values[offset : offset + count])
        offset += count
    return out


def _verify_random(
    probs: torch.Tensor,
    start: int,
    drafts: list[int],
    draft_probs: list[float],
    generator: torch.Generator | None,
    q: torch.Tensor | None = None,
) -> list[int]:
    uniforms = torch.rand(len(drafts), generator=generator, device=probs.device).tolist()
    # q(d) of each draft: 1 for a point mass. u < p / q is tested as u * q < p (q(d) > 0: d
    # was drawn from q).
    draft_q = [1.0] * len(drafts)
    if q is not None and drafts:
        index = torch.arange(len(drafts), device=q.device)
        draft_q = q[index, torch.tensor(drafts, device=q.device)].tolist()
    num_accepted = 0
    while (
        num_accepted < len(drafts)
        and uniforms[num_accepted] * draft_q[num_accepted] < draft_probs[num_accepted]
    ):
        num_accepted += 1
    dist = probs[start + num_accepted].clone()
    if num_accepted < len(drafts):
        if q is None:
            dist[drafts[num_accepted]] = 0.0  # max(0, p - q) for a point-mass q
        else:
            residual = (dist - q[num_accepted]).clamp_(min=0.0)
            # p == q (to rounding) leaves nothing: a rejection had probability ~0; draw from p.
            if float(residual.sum()) > 0.0:
                dist = residual
    # The sampler's exponential race: argmax(dist / E), E ~ Exp(1), picks i with dist[i] / sum.
    noise = torch.empty_like(dist).uniform_(generator=generator)
    token = int(dist.div_(noise.log_().neg_()).argmax())
    if float(dist[token]) <= 0.0:
        # Nothing left after removing a point-mass draft (it held all the mass, yet
        # u >= 1 - 1 ulp): the draft is the only token p allows.
        token = drafts[num_accepted]
    return drafts[:num_accepted] + [token]


def _logprob_rows(
    raw_logprobs: torch.Tensor,
    token_ids: list[list[int]],
    starts: list[int],
    counts: list[int | None],
    max_num_logprobs: int,
) -> list[list[tuple[list[int], list[float], int]]]:
    """Each emitted token's raw logprob, rank and the row's top alternatives at its position."""
    positions = [starts[i] + j for i, tokens in enumerate(token_ids) for j in range(len(tokens))]
    flat = [token for tokens in token_ids for token in tokens]
    device = raw_logprobs.device
    out = gather_logprobs(
        raw_logprobs[torch.tensor(positions, device=device)],
        torch.tensor(flat, device=device),
        max_num_logprobs,
    )
    all_ids, all_values = out.logprob_token_ids.tolist(), out.logprobs.tolist()
    all_ranks = out.ranks.tolist()
    rows: list[list[tuple[list[int], list[float], int]]] = []
    offset = 0
    for i, tokens in enumerate(token_ids):
        count = counts[i]
        width = 0 if count is None else 1 + count
        rows.append(
            [
                (all_ids[j][:width], all_values[j][:width], 0 if count is None else all_ranks[j])
                for j in range(offset, offset + len(tokens))
            ]
        )
        offset += len(tokens)
    return rows
