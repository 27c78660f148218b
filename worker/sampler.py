"""The sampler: from one step's logits to one token per request, plus optional logprobs.

Runs in worker processes (rank 0 samples; every rank may run it on identical logits). Order of
operations, matching what OpenAI and vLLM users expect:

1. logprobs, when asked, from the RAW logits (before penalties, temperature and filters), so they
   compare with ``log_softmax`` of the model's output;
2. token constraints: only ``allowed_token_ids``, ``logit_bias`` added, stop and EOS tokens
   masked until ``min_tokens`` are out, then what each row's grammar allows (structured
   outputs) (vLLM's order: before the penalties);
3. penalties: repetition (HF semantics, prompt and output tokens), presence and frequency (OpenAI
   semantics, output tokens only);
4. greedy rows take the argmax of the adjusted logits;
5. random rows: temperature, min-p, top-k, top-p, then an exponential race
   ``argmax(probs / Exp(1))``, which samples exactly from ``probs`` and lets each seeded row draw its
   noise from its own generator, so a seeded request gets the same tokens in any batch, at any row.

No step here reads a tensor back to the host: the branches depend only on host-side metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.protocol.messages import Logprobs
from conveyor.worker.device_buffers import to_device
from conveyor.worker.sampling_metadata import SamplingMetadata, TokenConstraints
from conveyor.worker.structured_output import apply_bitmask


@dataclass
class SamplerOutput:
    # [R] int64: the token each row sampled.
    sampled_token_ids: torch.Tensor
    # [R, 1 + max_num_logprobs] int64: the sampled token first, then the top-k in descending order.
    logprob_token_ids: torch.Tensor | None = None
    # [R, 1 + max_num_logprobs] float32: log-probabilities of those tokens under the raw logits.
    logprobs: torch.Tensor | None = None
    # [R] int64: rank of the sampled token in the raw distribution (1 = most likely).
    ranks: torch.Tensor | None = None


class Sampler:
    """Stateless: everything a step needs arrives in its ``SamplingMetadata``."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of ``logits`` ([R, V] float32); ``logits`` is not modified."""
        logits = logits.float()
        if metadata.no_adjustments and metadata.all_greedy and metadata.max_num_logprobs is None:
            return SamplerOutput(sampled_token_ids=logits.argmax(dim=-1))
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if metadata.token_constraints is not None:
            logits = apply_token_constraints(logits, metadata.token_constraints)
        logits = apply_penalties(logits, metadata)
        sampled = sample(logits, metadata)
        if raw_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        return gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)


def random_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The distribution random rows draw from: temperature, min-p, top-k, top-p, softmax (a
    greedy row's is meaningless but finite)."""
    temperature = metadata.temperature
    if not metadata.all_random:
        # Greedy rows are overwritten by the caller; dividing them by 1 keeps them finite.
        temperature = torch.where(temperature > 0.0, temperature, 1.0)
    logits = logits / temperature.unsqueeze(1)
    if metadata.min_p is not None:
        logits = apply_min_p(logits, metadata.min_p)
    if metadata.top_k is not None and metadata.top_p is None:
        logits = apply_top_k(logits, metadata.top_k, metadata.max_top_k)
    elif metadata.top_p is not None:
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
    return logits.softmax(dim=-1)


def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Greedy rows take the argmax; random rows go through temperature, filters and the race."""
    greedy = None if metadata.all_random else logits.argmax(dim=-1)
    if metadata.all_greedy:
        return greedy
    sampled = race(random_probs(logits, metadata), metadata.generators)
    if greedy is None:
        return sampled
    return torch.where(metadata.temperature > 0.0, sampled, greedy)


def race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Sample from each row of ``probs`` as ``argmax(probs / E)``, ``E ~ Exp(1)`` i.i.d.

    Token i wins with probability ``probs[i]`` (the minimum of independent exponentials with rates
    ``probs`` lands on i with that probability). Each row's outcome depends only on its own noise
    vector, which is what makes seeded rows independent of their neighbours.
    """
    # E = -log(U), U ~ Uniform[0, 1): on CPU uniform + log is ~4x faster than exponential_, and
    # E is never 0 (U < 1), so probs / E has no 0 / 0 = NaN that argmax would rank first; U = 0
    # gives E = inf and a score of 0, which never beats a real draw.
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.uniform_()
    # One draw of V values per seeded row per step: the generator advances the same way wherever
    # the row sits in the batch.
    for row, generator in generators.items():
        noise[row].uniform_(generator=generator)
    return probs.div_(noise.log_().neg_()).argmax(dim=-1)


def apply_token_constraints(logits: torch.Tensor, constraints: TokenConstraints) -> torch.Tensor:
    """Return the logits (a new tensor) with allow-lists, biases and bans applied."""
    logits = logits.clone()
    for row, allowed in constraints.allowed.items():
        kept = logits[row, allowed]
        logits[row] = float("-inf")
        logits[row, allowed] = kept
    if constraints.bias is not None:
        rows, token_ids, values = constraints.bias
        logits.index_put_((rows, token_ids), values.to(logits.dtype), accumulate=True)
    if constraints.banned is not None:
        # new_full fills on the device; a torch.tensor(..., device=...) scalar would upload
        # from the host and wait for the device.
        logits.index_put_(constraints.banned, logits.new_full((), float("-inf")))
    if constraints.grammar_bitmask is not None:
        rows = constraints.grammar_rows
        if rows is None or len(rows) == logits.shape[0]:
            apply_bitmask(logits, constraints.grammar_bitmask)
        else:
            constrained = logits[rows]
            apply_bitmask(constrained, constraints.grammar_bitmask)
            logits[rows] = constrained
    return logits


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Return penalised logits (a new tensor), or ``logits`` itself when no row has penalties."""
    if metadata.no_penalties:
        return logits
    num_rows, vocab_size = logits.shape
    output_counts = _count_output_tokens(metadata.output_token_ids, num_rows, vocab_size, logits)
    if metadata.repetition_penalties is not None:
        seen = output_counts > 0
        if metadata.prompt_token_ids is not None:
            seen |= _prompt_mask(metadata.prompt_token_ids, num_rows, vocab_size)
        penalty = metadata.repetition_penalties.unsqueeze(1)
        # HF's RepetitionPenaltyLogitsProcessor: a penalty > 1 always makes a seen token less
        # likely, so positive logits shrink and negative ones grow in magnitude.
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    if metadata.frequency_penalties is not None:
        logits = logits - metadata.frequency_penalties.unsqueeze(1) * output_counts
    if metadata.presence_penalties is not None:
        present = (output_counts > 0).to(logits.dtype)
        logits = logits - metadata.presence_penalties.unsqueeze(1) * present
    return logits


def _count_output_tokens(
    output_token_ids: list[list[int]], num_rows: int, vocab_size: int, like: torch.Tensor
) -> torch.Tensor:
    """[R, V] float32 counts of each token among each row's generated tokens."""
    counts = torch.zeros((num_rows, vocab_size), dtype=like.dtype, device=like.device)
    lengths = [len(ids) for ids in output_token_ids]
    if sum(lengths) == 0:
        return counts
    flat = [token for ids in output_token_ids for token in ids]
    token_ids = to_device(torch.tensor(flat, dtype=torch.int64), like.device)
    rows = torch.repeat_interleave(torch.arange(num_rows), torch.tensor(lengths))
    rows = to_device(rows, like.device)
    ones = torch.ones(len(flat), dtype=like.dtype, device=like.device)
    return counts.index_put_((rows, token_ids), ones, accumulate=True)


def _prompt_mask(prompt_token_ids: torch.Tensor, num_rows: int, vocab_size: int) -> torch.Tensor:
    # The padding id is vocab_size: it lands in the extra column, which is dropped.
    mask = torch.zeros((num_rows, vocab_size + 1), dtype=torch.bool, device=prompt_token_ids.device)
    mask.scatter_(1, prompt_token_ids, True)
    return mask[:, :vocab_size]


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's top one (in place)."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits (0 = all), in place, without a full sort."""
    top_values = logits.topk(max_top_k, dim=-1).values
    # Rows with top_k == 0 read index -1 and get -inf instead: they keep everything.
    kth_value = top_values.gather(1, (top_k - 1).clamp_min(0).unsqueeze(1))
    kth_value = kth_value.masked_fill_((top_k == 0).unsqueeze(1), float("-inf"))
    return logits.masked_fill_(logits < kth_value, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """Top-k, then top-p on the renormalised survivors (in place), with one sort per row."""
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab_size)
        kth_value = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth_value, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # Drop the least likely tokens while their total mass stays within 1 - top_p; what remains
    # holds at least top_p. The most likely token always stays.
    drop = cumulative <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, float("-inf"))
    return logits.scatter_(1, order, sorted_logits)


def gather_logprobs(
    raw_logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: int
) -> SamplerOutput:
    """Sampled token first, then the ``num_logprobs`` most likely tokens, and the sampled rank."""
    sampled_logprob = raw_logprobs.gather(1, sampled.unsqueeze(1))
    # Rank counts strictly better tokens, so ties share the best rank.
    ranks = (raw_logprobs > sampled_logprob).sum(dim=-1) + 1
    top_logprobs, top_ids = raw_logprobs.topk(num_logprobs, dim=-1)
    return SamplerOutput(
        sampled_token_ids=sampled,
        logprob_token_ids=torch.cat([sampled.unsqueeze(1), top_ids], dim=1),
        logprobs=torch.cat([sampled_logprob, top_logprobs], dim=1),
        ranks=ranks,
    )


def logprobs_to_wire(
    output: SamplerOutput, num_logprobs_per_row: list[int | None]
) -> Logprobs | None:
    """Host copy of a step's logprobs, one row per sampled request.

    Row i keeps ``1 + num_logprobs_per_row[i]`` entries; a row that did not ask (``None``) gets
    empty lists and rank 0. Returns None when no row asked.
    """
    if output.logprobs is None:
        return None
    # One device-to-host copy per tensor, then plain list slicing.
    all_token_ids = output.logprob_token_ids.tolist()
    all_logprobs = output.logprobs.tolist()
    all_ranks = output.ranks.tolist()
    token_ids: list[list[int]] = []
    logprobs: list[list[float]] = []
    ranks: list[int] = []
    for row, count in enumerate(num_logprobs_per_row):
        width = 0 if count is None else 1 + count
        token_ids.append(all_token_ids[row][:width])
        logprobs.append(all_logprobs[row][:width])
        ranks.append(0 if count is None else all_ranks[row])
    return Logprobs(token_ids=token_ids, logprobs=logprobs, ranks=ranks)
