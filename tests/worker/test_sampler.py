"""Sampler behaviour on hand-made logits: greedy, filters, seeds, penalties, logprobs, distribution."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
import torch

from conveyor.protocol.sampling_params import SamplingParams
from conveyor.worker.sampler import Sampler, SamplerOutput, apply_penalties, logprobs_to_wire
from conveyor.worker.sampling_metadata import SamplingMetadata, make_sampling_metadata

CPU = torch.device("cpu")
sampler = Sampler()


def metadata_for(
    params: list[SamplingParams],
    vocab_size: int,
    generators: dict[int, torch.Generator] | None = None,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
) -> SamplingMetadata:
    return make_sampling_metadata(
        params,
        generators or {},
        prompts if prompts is not None else [[] for _ in params],
        outputs if outputs is not None else [[] for _ in params],
        vocab_size,
        CPU,
    )


def run(logits: torch.Tensor, params: list[SamplingParams], **kwargs) -> SamplerOutput:
    return sampler(logits, metadata_for(params, logits.shape[1], **kwargs))


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def sample_many(logits_row: torch.Tensor, params: SamplingParams, num_samples: int) -> torch.Tensor:
    """Draw num_samples tokens from one row by replicating it (each row has its own noise)."""
    torch.manual_seed(1234)
    logits = logits_row.unsqueeze(0).expand(num_samples, -1).contiguous()
    return run(logits, [params] * num_samples).sampled_token_ids


# ---------------------------------------------------------------- metadata


def test_metadata_leaves_unused_features_off():
    meta = metadata_for([SamplingParams(temperature=0.0), SamplingParams()], vocab_size=10)
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None
    assert meta.no_penalties and meta.prompt_token_ids is None
    assert meta.max_num_logprobs is None
    assert not meta.all_greedy and not meta.all_random


def test_metadata_builds_what_rows_use():
    params = [
        SamplingParams(temperature=0.0, top_k=5, seed=1),  # greedy: its filters and seed are moot
        SamplingParams(top_k=1, seed=2),  # top_k == 1 is greedy
        SamplingParams(top_k=50, top_p=0.9, logprobs=3, seed=3),
        SamplingParams(repetition_penalty=1.2, logprobs=0),
    ]
    gens = {0: seeded(1), 1: seeded(2), 2: seeded(3)}
    meta = metadata_for(params, 20, gens, prompts=[[1, 2], [3], [4, 5, 6], [7]])
    assert meta.temperature.tolist() == [0.0, 0.0, 1.0, 1.0]
    assert meta.top_k.tolist() == [0, 0, 20, 0] and meta.max_top_k == 20
    assert meta.top_p.tolist() == pytest.approx([1.0, 1.0, 0.9, 1.0])
    assert meta.min_p is None
    assert list(meta.generators) == [2]
    assert meta.max_num_logprobs == 3
    assert meta.presence_penalties is None and meta.frequency_penalties is None
    assert meta.repetition_penalties.tolist() == pytest.approx([1.0, 1.0, 1.0, 1.2])
    assert meta.prompt_token_ids.tolist() == [[1, 2, 20], [3, 20, 20], [4, 5, 6], [7, 20, 20]]


# ---------------------------------------------------------------- greedy and top_k = 1


def test_greedy_is_argmax_and_leaves_logits_alone():
    logits = torch.randn(6, 100, generator=seeded(0))
    before = logits.clone()
    out = run(logits, [SamplingParams(temperature=0.0)] * 6)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None and out.ranks is None
    assert torch.equal(logits, before)


def test_greedy_rows_in_a_mixed_batch_are_argmax():
    logits = torch.randn(8, 100, generator=seeded(1))
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5, top_p=0.8) for i in range(8)]
    out = run(logits, params)
    assert torch.equal(out.sampled_token_ids[1::2], logits[1::2].argmax(dim=-1))


@pytest.mark.parametrize("top_p", [None, 1.0], ids=["topk-only", "sort-path"])
def test_top_k_one_filter_equals_greedy(top_p):
    # Bypass make_sampling_metadata (which routes top_k == 1 to greedy) to exercise the filters.
    num_rows, vocab_size = 64, 1000
    logits = torch.randn(num_rows, vocab_size, generator=seeded(2)) * 3
    meta = metadata_for([SamplingParams()] * num_rows, vocab_size)
    meta = dataclasses.replace(
        meta,
        top_k=torch.ones(num_rows, dtype=torch.int64),
        max_top_k=1,
        top_p=None if top_p is None else torch.full((num_rows,), top_p),
    )
    torch.manual_seed(0)
    assert torch.equal(sampler(logits, meta).sampled_token_ids, logits.argmax(dim=-1))
    # And through the public path, with a seed and temperature 1.
    out = run(logits, [SamplingParams(top_k=1, seed=5)] * num_rows)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


# ---------------------------------------------------------------- seeds


def _request_logits(request: int, step: int, vocab_size: int) -> torch.Tensor:
    # Each request's logits at a step are fixed, whatever batch it is in; flat enough that the
    # noise, not the logits, decides the token.
    return torch.randn(vocab_size, generator=seeded(1000 * request + step)) * 0.5


def _run_steps(batch: list[int], params: dict[int, SamplingParams], num_steps: int) -> dict:
    """Run a batch of requests for several steps; return each request's token sequence."""
    vocab_size = 500
    generators = {r: seeded(p.seed) for r, p in params.items() if p.seed is not None}
    tokens: dict[int, list[int]] = {r: [] for r in batch}
    for step in range(num_steps):
        logits = torch.stack([_request_logits(r, step, vocab_size) for r in batch])
        row_generators = {row: generators[r] for row, r in enumerate(batch) if r in generators}
        meta = metadata_for([params[r] for r in batch], vocab_size, row_generators)
        for r, token in zip(batch, sampler(logits, meta).sampled_token_ids.tolist()):
            tokens[r].append(token)
    return tokens


def test_seeded_rows_reproduce_across_batches_and_rows():
    params = {
        0: SamplingParams(seed=42),
        1: SamplingParams(seed=7, top_k=40, top_p=0.95, min_p=0.01, temperature=0.8),
        2: SamplingParams(),  # unseeded neighbours
        3: SamplingParams(temperature=0.0),
        4: SamplingParams(top_p=0.5),
    }
    alone = {r: _run_steps([r], params, 8)[r] for r in (0, 1)}
    torch.manual_seed(1)
    mixed = _run_steps([2, 1, 3, 0], params, 8)
    torch.manual_seed(2)
    reordered = _run_steps([0, 4, 2, 1], params, 8)
    for r in (0, 1):
        assert mixed[r] == alone[r] == reordered[r]
    # Unseeded rows do vary with the global generator.
    assert mixed[2] != reordered[2]


def test_different_seeds_give_different_tokens():
    runs = {seed: _run_steps([0], {0: SamplingParams(seed=seed)}, 10)[0] for seed in (1, 2)}
    assert runs[1] != runs[2]
    assert _run_steps([0], {0: SamplingParams(seed=1)}, 10)[0] == runs[1]


# ---------------------------------------------------------------- filters keep their support


def _allowed_top_p(probs: torch.Tensor, top_p: float) -> set[int]:
    order = probs.argsort(descending=True)
    cumulative = probs[order].cumsum(0)
    num_kept = int((cumulative < top_p).sum()) + 1
    return set(order[:num_kept].tolist())


def _filter_case(name: str, probs: torch.Tensor) -> tuple[SamplingParams, set[int]]:
    if name == "top_k":
        return SamplingParams(top_k=5), set(probs.topk(5).indices.tolist())
    if name == "top_p":
        return SamplingParams(top_p=0.6), _allowed_top_p(probs, 0.6)
    if name == "min_p":
        return SamplingParams(min_p=0.3), set((probs >= 0.3 * probs.max()).nonzero()[:, 0].tolist())
    top = probs.topk(8)
    kept = _allowed_top_p(top.values / top.values.sum(), 0.7)
    return SamplingParams(top_k=8, top_p=0.7), {top.indices[i].item() for i in kept}


@pytest.mark.parametrize("name", ["top_k", "top_p", "min_p", "top_k_top_p"])
def test_filters_never_sample_a_filtered_token(name):
    # Distinct, well-separated logits so no cumulative sum sits on a float boundary.
    logits = torch.linspace(2.0, -2.0, 30)[torch.randperm(30, generator=seeded(3))]
    params, allowed = _filter_case(name, logits.softmax(0))
    assert 1 < len(allowed) < 30
    sampled = set(sample_many(logits, params, 20_000).tolist())
    # Exactly the allowed set: nothing outside it, and every allowed token does occur.
    assert sampled == allowed


# ---------------------------------------------------------------- temperature


def test_tiny_temperature_behaves_like_greedy():
    logits = torch.randn(256, 50, generator=seeded(4))
    greedy = logits.argmax(dim=-1)
    # 1e-3 divides gaps of ~0.01 into ~10 nats: the argmax wins nearly always, never a NaN.
    out = run(logits, [SamplingParams(temperature=1e-3)] * 256).sampled_token_ids
    assert (out == greedy).float().mean() > 0.95
    # Below the greedy threshold the row takes the greedy path exactly.
    meta = metadata_for([SamplingParams(temperature=1e-9)] * 256, 50)
    assert meta.all_greedy
    assert torch.equal(sampler(logits * 1e3, meta).sampled_token_ids, greedy)


def test_high_temperature_flattens_the_distribution():
    logits = torch.tensor([3.0, 0.0, 0.0, 0.0])
    hot = sample_many(logits, SamplingParams(temperature=100.0), 20_000)
    cold = sample_many(logits, SamplingParams(temperature=0.4), 20_000)
    assert (hot == 0).float().mean() < 0.3 < 0.99 < (cold == 0).float().mean()


# ---------------------------------------------------------------- penalties


def _penalised(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]):
    meta = metadata_for([params], logits.shape[1], prompts=[prompt], outputs=[output])
    return apply_penalties(logits, meta)


def test_repetition_penalty_matches_hf_by_hand_and_by_library():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    result = _penalised(logits, SamplingParams(repetition_penalty=2.0), [0, 1], [1, 4])
    # Seen: 0 (prompt), 1 (both), 4 (output). Positive / 2, negative * 2, unseen untouched.
    assert result.tolist() == [[1.0, -2.0, 0.5, 3.0, -4.0, 1.0]]
    processor = pytest.importorskip("transformers").RepetitionPenaltyLogitsProcessor(1.3)
    logits = torch.randn(1, 64, generator=seeded(5))
    history = [3, 9, 9, 17, 40, 3, 63]
    expected = processor(torch.tensor([history]), logits.clone())
    actual = _penalised(logits, SamplingParams(repetition_penalty=1.3), history[:4], history[4:])
    torch.testing.assert_close(actual, expected)


def test_presence_and_frequency_penalties_follow_openai_on_outputs_only():
    logits = torch.zeros(1, 8)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    result = _penalised(logits, params, prompt=[1, 2], output=[3, 3, 5])
    expected = torch.zeros(1, 8)
    expected[0, 3] = -(2 * 0.25 + 0.5)
    expected[0, 5] = -(1 * 0.25 + 0.5)
    assert torch.equal(result, expected)  # prompt tokens 1, 2 untouched


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(presence_penalty=1.0),
        SamplingParams(frequency_penalty=0.5),
    ],
    ids=["repetition", "presence", "frequency"],
)
def test_each_penalty_makes_a_repeated_token_less_likely(params):
    logits = torch.tensor([[1.0, 2.0, 0.5, 1.8]])
    before = logits.softmax(-1)[0, 1]
    after = _penalised(logits, params, prompt=[0], output=[1, 1]).softmax(-1)[0, 1]
    assert after < before
    # Strong enough to move greedy off the repeated token, at any row of a mixed batch.
    greedy = msgspec.structs.replace(params, temperature=0.0)
    out = run(logits.repeat(2, 1), [SamplingParams(temperature=0.0), greedy], outputs=[[], [1, 1]])
    assert out.sampled_token_ids.tolist() == [1, 3]


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_sampled_first_ranked_and_sorted():
    vocab_size = 40
    logits = torch.randn(5, vocab_size, generator=seeded(6)) * 2
    params = [
        SamplingParams(logprobs=3, temperature=0.7, top_k=10, presence_penalty=1.0),
        SamplingParams(logprobs=0),
        SamplingParams(),  # did not ask
        SamplingParams(logprobs=5, temperature=0.0, repetition_penalty=1.5),
        SamplingParams(logprobs=2, seed=9),
    ]
    outputs = [[1, 2], [], [], [4], []]
    out = run(logits, params, generators={4: seeded(9)}, outputs=outputs, prompts=[[0]] * 5)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprob_token_ids.shape == (5, 6) and out.logprobs.shape == (5, 6)
    sampled = out.sampled_token_ids
    assert torch.equal(out.logprob_token_ids[:, 0], sampled)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.logprob_token_ids))
    assert torch.equal(out.logprob_token_ids[:, 1:], raw.argsort(dim=-1, descending=True)[:, :5])
    assert (out.logprobs[:, 1:].diff(dim=1) <= 0).all()
    position = (raw.argsort(dim=-1, descending=True) == sampled.unsqueeze(1)).int().argmax(dim=-1)
    assert torch.equal(out.ranks, position + 1)

    wire = logprobs_to_wire(out, [p.logprobs for p in params])
    assert [len(row) for row in wire.token_ids] == [4, 1, 0, 6, 3]
    assert [len(row) for row in wire.logprobs] == [4, 1, 0, 6, 3]
    assert wire.token_ids[0] == out.logprob_token_ids[0, :4].tolist()
    assert wire.ranks[2] == 0 and wire.ranks[1] == out.ranks[1].item() >= 1


def test_no_logprobs_means_nothing_on_the_wire():
    out = run(torch.randn(2, 10), [SamplingParams(), SamplingParams(temperature=0.0)])
    assert out.logprobs is None and logprobs_to_wire(out, [None, None]) is None


# ---------------------------------------------------------------- the distribution itself


def test_unfiltered_sampling_matches_softmax_over_temperature():
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5, 0.7, 1.3])
    temperature = 0.7
    expected = (logits / temperature).softmax(0)
    num_samples = 250_000
    sampled = sample_many(logits, SamplingParams(temperature=temperature), num_samples)
    empirical = torch.bincount(sampled, minlength=8).double() / num_samples
    # Standard error <= 0.001 per bin; 0.005 is five of them.
    assert (empirical - expected.double()).abs().max() < 0.005


def test_one_seeded_request_over_many_steps_follows_softmax():
    # The per-row generator path must sample the same distribution as the batched one.
    logits = torch.tensor([[0.5, 1.5, -0.5, 1.0]])
    expected = logits.softmax(-1)[0].double()
    meta = metadata_for([SamplingParams(seed=11)], 4, {0: seeded(11)})
    num_steps = 4000
    tokens = torch.cat([sampler(logits, meta).sampled_token_ids for _ in range(num_steps)])
    empirical = torch.bincount(tokens, minlength=4).double() / num_steps
    assert (empirical - expected).abs().max() < 0.035
