"""Per-step sampling inputs: one row per request that samples a token this step.

Runs in worker processes. The model runner calls ``make_sampling_metadata`` with the sampling
parameters of the requests whose prompt is complete this step (batch order) and hands the result
to the ``Sampler``. Every decision that needs a Python value (is anyone greedy, what is the largest
top-k) is made here on the host, so the sampler never synchronises with the device to decide which
kernels to run. Every tensor is built on the host and uploaded asynchronously (``to_device``): a
``torch.tensor(values, device="cuda")`` would block until the device caught up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from conveyor.protocol.sampling_params import SamplingParams
from conveyor.worker.device_buffers import to_device

# Below this a temperature only amplifies float noise (logits / 1e-6 overflow into ties or NaN), and
# the distribution is already a point mass on the argmax: treat the row as greedy.
MIN_TEMPERATURE = 1e-5


@dataclass
class TokenConstraints:
    """Per-row changes to the logits, as sparse (row, token) lists: a dense [R, V] tensor per
    step would cost more than the rows it changes.

    ``bias``: logit_bias entries, added. ``banned``: tokens a row may not sample now (its stop
    and EOS tokens until ``min_tokens`` are out). ``allowed``: row -> the only tokens it may
    sample (allowed_token_ids). ``grammar_bitmask``: what each row's grammar allows next.
    """

    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    allowed: dict[int, torch.Tensor] = field(default_factory=dict)
    # [G, ceil(V / 32)] int32 from the grammar matchers (structured outputs) of the rows
    # ``grammar_rows`` ([G] int64), applied last; the other rows pay nothing for it.
    grammar_bitmask: torch.Tensor | None = None
    grammar_rows: torch.Tensor | None = None


@dataclass
class SamplingMetadata:
    """Sampling inputs for one step, one row per sampling request, in batch order.

    Filters and penalties are ``None`` when no row uses them, so the sampler can skip their
    kernels (the common case is a batch of plain temperature or greedy requests).
    """

    # [R] float32; 0.0 marks a greedy row (also set for top_k == 1, which is the same thing).
    temperature: torch.Tensor
    # [R] int64, 0 = off (always 0 on greedy rows); None when no random row uses top-k.
    top_k: torch.Tensor | None
    # [R] float32, 1.0 = off; None when no random row uses top-p.
    top_p: torch.Tensor | None
    # [R] float32, 0.0 = off; None when no random row uses min-p.
    min_p: torch.Tensor | None
    all_greedy: bool
    all_random: bool
    # Row -> the request's own generator, for seeded random rows only.
    generators: dict[int, torch.Generator]
    # Largest logprobs count asked for by any row; None when nobody asked.
    max_num_logprobs: int | None
    # Each penalty tensor is [R] and None when no row uses that penalty.
    presence_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    # [R, max_prompt_len] int64 padded with vocab_size; only set with repetition penalties, the
    # only penalty that looks at the prompt.
    prompt_token_ids: torch.Tensor | None
    # Per row, the tokens generated so far (may be empty); read only by the penalties.
    output_token_ids: list[list[int]]
    # Largest top_k over rows (0 when top_k is None): sizes torch.topk without a device sync.
    max_top_k: int = 0
    # What rows may not sample or are pushed towards; None when no row has any.
    token_constraints: TokenConstraints | None = None

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @property
    def no_adjustments(self) -> bool:
        """Nothing changes the logits before sampling: no penalty, bias or mask."""
        return self.no_penalties and self.token_constraints is None

    @property
    def no_penalties(self) -> bool:
        return (
            self.presence_penalties is None
            and self.frequency_penalties is None
            and self.repetition_penalties is None
        )


def make_sampling_metadata(
    params: list[SamplingParams],
    generators: dict[int, torch.Generator],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    vocab_size: int,
    device: torch.device,
    num_output_tokens: list[int] | None = None,
    eos_token_ids: Collection[int] = (),
    grammar_bitmask: torch.Tensor | None = None,
    grammar_ended_rows: Collection[int] = (),
    grammar_rows: list[int] | None = None,
) -> SamplingMetadata:
    """Build the step's metadata, one row per entry of ``params`` (batch order).

    ``num_output_tokens`` (per row, before this step's token) decides which rows still hide
    their stop and EOS tokens (``min_tokens``); None means every row is past its minimum. A row
    in ``grammar_ended_rows`` has a complete structured output: EOS is all its grammar allows,
    so ``min_tokens`` gives way there.

    ``generators`` maps row -> that request's own generator (seeded requests only). It must live on
    ``device`` and be kept for the request's whole life, preemptions included: a seeded request
    reproduces its tokens because its generator advances exactly once per token it samples.
    """
    temperatures = [_effective_temperature(p) for p in params]
    is_random = [t > 0.0 for t in temperatures]
    top_ks = [min(p.top_k, vocab_size) if r else 0 for p, r in zip(params, is_random)]
    top_ps = [p.top_p if r else 1.0 for p, r in zip(params, is_random)]
    min_ps = [p.min_p if r else 0.0 for p, r in zip(params, is_random)]
    repetition = [p.repetition_penalty for p in params]
    logprob_counts = [p.logprobs for p in params if p.logprobs is not None]
    use_top_k = any(k > 0 for k in top_ks)
    return SamplingMetadata(
        temperature=_tensor(temperatures, torch.float32, device),
        top_k=_tensor_if(use_top_k, top_ks, torch.int64, device),
        top_p=_tensor_if(any(p < 1.0 for p in top_ps), top_ps, torch.float32, device),
        min_p=_tensor_if(any(p > 0.0 for p in min_ps), min_ps, torch.float32, device),
        all_greedy=not any(is_random),
        all_random=all(is_random),
        # A greedy row never draws noise, so its generator (if any) is not needed.
        generators={row: g for row, g in generators.items() if is_random[row]},
        max_num_logprobs=max(logprob_counts) if logprob_counts else None,
        presence_penalties=_penalty_tensor([p.presence_penalty for p in params], 0.0, device),
        frequency_penalties=_penalty_tensor([p.frequency_penalty for p in params], 0.0, device),
        repetition_penalties=_penalty_tensor(repetition, 1.0, device),
        prompt_token_ids=(
            _pad_prompts(prompt_token_ids, vocab_size, device)
            if any(r != 1.0 for r in repetition)
            else None
        ),
        output_token_ids=output_token_ids,
        max_top_k=max(top_ks) if use_top_k else 0,
        token_constraints=make_token_constraints(
            params,
            num_output_tokens,
            eos_token_ids,
            device,
            grammar_bitmask,
            grammar_ended_rows,
            grammar_rows,
        ),
    )


def with_grammar_bitmask(
    metadata: SamplingMetadata, bitmask: torch.Tensor, rows: list[int], device: torch.device
) -> SamplingMetadata:
    """``metadata`` with the step's grammar bitmask (host, [len(rows), ceil(V / 32)] int32) for
    the sampling rows ``rows`` added. The runner fills the masks after launching the forward, so
    they arrive apart from the rest."""
    constraints = metadata.token_constraints or TokenConstraints()
    constraints = dataclasses.replace(
        constraints,
        grammar_bitmask=to_device(bitmask, device),
        grammar_rows=_tensor(rows, torch.int64, device),
    )
    return dataclasses.replace(metadata, token_constraints=constraints)


def make_token_constraints(
    params: list[SamplingParams],
    num_output_tokens: list[int] | None,
    eos_token_ids: Collection[int],
    device: torch.device,
    grammar_bitmask: torch.Tensor | None = None,
    grammar_ended_rows: Collection[int] = (),
    grammar_rows: list[int] | None = None,
) -> TokenConstraints | None:
    """The step's logit biases and masks, or None when no row has any (the common case)."""
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_values: list[float] = []
    banned_rows: list[int] = []
    banned_ids: list[int] = []
    allowed: dict[int, torch.Tensor] = {}
    for row, p in enumerate(params):
        if p.logit_bias:
            bias_rows += [row] * len(p.logit_bias)
            bias_ids += p.logit_bias.keys()
            bias_values += p.logit_bias.values()
        if p.allowed_token_ids is not None:
            allowed[row] = _tensor(p.allowed_token_ids, torch.int64, device)
        min_tokens_due = num_output_tokens is not None and num_output_tokens[row] < p.min_tokens
        if min_tokens_due and row not in grammar_ended_rows:
            # vLLM's min_tokens: no stop token (EOS too, unless ignored) before the minimum.
            stop_ids = set(p.stop_token_ids)
            if not p.ignore_eos:
                stop_ids.update(eos_token_ids)
            banned_rows += [row] * len(stop_ids)
            banned_ids += stop_ids
    if not (bias_rows or banned_rows or allowed) and grammar_bitmask is None:
        return None

    def ids(values: list[int]) -> torch.Tensor:
        return _tensor(values, torch.int64, device)

    return TokenConstraints(
        bias=(
            (ids(bias_rows), ids(bias_ids), _tensor(bias_values, torch.float32, device))
            if bias_rows
            else None
        ),
        banned=(ids(banned_rows), ids(banned_ids)) if banned_rows else None,
        allowed=allowed,
        grammar_bitmask=grammar_bitmask,
        grammar_rows=None if grammar_rows is None else ids(grammar_rows),
    )


def _effective_temperature(p: SamplingParams) -> float:
    # top_k == 1 keeps only the argmax, so the row is greedy whatever its temperature; taking the
    # greedy path skips the sort and breaks ties the same way greedy requests do.
    if p.temperature < MIN_TEMPERATURE or p.top_k == 1:
        return 0.0
    return p.temperature


def _tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=dtype), device)


def _tensor_if(
    used: bool, values: list, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    return _tensor(values, dtype, device) if used else None


def _penalty_tensor(
    values: list[float], neutral: float, device: torch.device
) -> torch.Tensor | None:
    return _tensor_if(any(v != neutral for v in values), values, torch.float32, device)


def _pad_prompts(prompts: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    # Padding with vocab_size lets the sampler scatter into a [R, V + 1] mask and drop the last
    # column, instead of masking the padding out separately.
    width = max((len(p) for p in prompts), default=0)
    padded = torch.full((len(prompts), width), vocab_size, dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        padded[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.int64)
    return to_device(padded, device)
