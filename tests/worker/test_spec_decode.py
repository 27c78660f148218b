"""The worker's half of speculative decoding: n-gram lookup and draft verification.

The statistical test is the one that matters for sampling: with drafts, each emitted token must
follow the distribution the sampler would draw it from without them (chi-square over thousands
of seeded draws on a 6-token vocabulary, for drafts the target likes and drafts it dislikes).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from conveyor.protocol import SamplingParams
from conveyor.worker.sampler import Sampler
from conveyor.worker.sampling_metadata import make_sampling_metadata
from conveyor.worker.spec_decode.ngram import propose_ngram
from conveyor.worker.spec_decode.rejection_sampler import verify

VOCAB = 6


def test_ngram_takes_the_longest_recurring_suffix_and_its_first_occurrence() -> None:
    tokens = np.array([1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 1, 2, 3, 4])
    # Suffix [2, 3, 4] occurs at 1 and 6; the first is followed by 5, 9, 2.
    assert propose_ngram(tokens, 3, 2, 3) == [5, 9, 2]
    # Suffix [1, 2, 3, 4] (max_n 4) occurs only at 0: followed by 5, 9.
    assert propose_ngram(tokens, 2, 2, 4) == [5, 9]
    # Nothing recurs with min_n 2: no draft.
    assert propose_ngram(np.array([1, 2, 3, 4, 5]), 3, 2, 3) == []
    # A draft may be shorter than k where the history ends.
    assert propose_ngram(np.array([7, 8, 9, 7, 8]), 4, 2, 2) == [9, 7, 8]
    assert propose_ngram(np.array([5]), 3, 1, 3) == []


def _propose_by_every_window(tokens, k, min_n, max_n):
    """The lookup written the slow, obvious way: each suffix length, longest first, against
    every earlier window."""
    tokens = list(tokens)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        if n <= 0:
            break
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_ngram_lookup_is_the_every_window_search_on_random_token_runs():
    rng = np.random.default_rng(7)
    for trial in range(3000):
        # Few distinct tokens and repeated pieces: many partial matches of every length.
        length = int(rng.integers(1, 60))
        tokens = rng.integers(0, int(rng.integers(1, 6)), length)
        if trial % 3 == 0 and length > 8:
            piece = tokens[: length // 3]
            tokens = np.concatenate([tokens, piece])
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 7))
        k = int(rng.integers(1, 6))
        expected = _propose_by_every_window(tokens, k, min_n, max_n)
        assert propose_ngram(tokens, k, min_n, max_n) == expected, (
            tokens.tolist(),
            k,
            min_n,
            max_n,
        )


def _metadata(params: list[SamplingParams]):
    return make_sampling_metadata(
        params, {}, [[] for _ in params], [[] for _ in params], VOCAB, torch.device("cpu")
    )


def test_greedy_accepts_while_drafts_are_the_argmax() -> None:
    logits = torch.full((4, VOCAB), -5.0)
    for position, best in enumerate([2, 4, 1, 3]):
        logits[position, best] = 5.0
    greedy = SamplingParams(temperature=0.0)
    cases = {(2, 4, 1): [2, 4, 1, 3], (2, 4, 5): [2, 4, 1], (0, 4, 1): [2], (2, 0, 1): [2, 4]}
    for drafts, want in cases.items():
        verified = verify(logits, [list(drafts)], _metadata([greedy] * 4), [False], [None], [None])
        assert verified.token_ids == [want]


def _target(logits: torch.Tensor, temperature: float, top_k: int) -> np.ndarray:
    """What the sampler draws from, computed independently: top-k of logits / T, softmax."""
    scaled = logits.double().numpy() / temperature
    kept = np.argsort(scaled)[::-1][:top_k]
    probs = np.zeros(VOCAB)
    probs[kept] = np.exp(scaled[kept] - scaled[kept].max())
    return probs / probs.sum()


@pytest.mark.parametrize("first_draft", [0, 3], ids=["likely-draft", "unlikely-draft"])
def test_sampled_tokens_follow_the_target_distribution(first_draft) -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 1.5
    logits[0, 0] += 2.0  # token 0 likely at the first position, token 3 outside the top 5
    logits[0, 3] = -9.0
    params = SamplingParams(temperature=0.8, top_k=5)
    drafts = [first_draft, 2]
    metadata = _metadata([params] * 3)
    num_draws = 6000
    first, second = [], []
    for seed in range(num_draws):
        generator = torch.Generator().manual_seed(seed)
        tokens = verify(logits, [drafts], metadata, [True], [generator], [None]).token_ids[0]
        first.append(tokens[0])
        if tokens[0] == drafts[0]:
            # The second position was scored after the first draft: its token follows p_1.
            second.append(tokens[1])
    checks = [(first, 0), (second, 1)] if first_draft == 0 else [(first, 0)]
    for observed, position in checks:
        expected = _target(logits[position], 0.8, 5)
        counts = np.bincount(observed, minlength=VOCAB)
        assert counts[expected == 0].sum() == 0, "a token the filters remove was emitted"
        support = expected > 0
        result = chisquare(counts[support], expected[support] * len(observed))
        assert result.pvalue > 1e-3, (position, counts, expected * len(observed))
    if first_draft == 0:
        assert len(second) > num_draws // 10  # enough draws for the second position
    else:
        assert not second  # a token top-k removed is never accepted
    # Against the sampler itself, drawing without drafts: one distribution (two-sample test).
    sampler_metadata = _metadata([params])
    plain = [int(Sampler()(logits[:1], sampler_metadata).sampled_token_ids) for _ in range(3000)]
    table = np.array([np.bincount(first, minlength=VOCAB), np.bincount(plain, minlength=VOCAB)])
    table = table[:, table.sum(axis=0) > 0]
    assert chi2_contingency(table).pvalue > 1e-3


def test_seeded_rows_repeat_their_tokens() -> None:
    logits = torch.randn(5, VOCAB)
    params = SamplingParams(temperature=1.0, seed=7)
    metadata = _metadata([params] * 5)
    runs = [
        verify(
            logits, [[1, 2, 3, 4]], metadata, [True], [torch.Generator().manual_seed(7)], [None]
        ).token_ids
        for _ in range(3)
    ]
    assert runs[0] == runs[1] == runs[2]


def test_logprobs_of_accepted_tokens_are_the_raw_distributions() -> None:
    logits = torch.randn(3, VOCAB)
    greedy = SamplingParams(temperature=0.0, logprobs=2)
    best = logits.argmax(dim=-1).tolist()
    verified = verify(logits, [[best[0], best[1]]], _metadata([greedy] * 3), [False], [None], [2])
    assert verified.token_ids == [best]
    raw = torch.log_softmax(logits, dim=-1)
    rows = verified.logprob_rows[0]
    assert len(rows) == 3
    for position, (token_ids, values, rank) in enumerate(rows):
        assert token_ids[0] == best[position] and rank == 1
        assert values[0] == pytest.approx(float(raw[position, best[position]]), abs=1e-6)
        assert len(token_ids) == 3


def test_a_grammar_cuts_drafts_at_the_first_refused_token_and_masks_each_position(
    tiny_model_dir,
) -> None:
    """_GrammarChecks: the longest allowed prefix of the drafts, one mask per verified position
    (the matcher advanced over the drafts to make them, then rolled back), and after
    verification the matcher advances over the emitted tokens only."""
    import json
    from types import SimpleNamespace

    from llguidance import grammar_from

    from conveyor.frontend.tokenizer import load_tokenizer
    from conveyor.worker.input_batch import InputBatch
    from conveyor.worker.spec_decode.spec_step import _GrammarChecks
    from conveyor.worker.structured_output import GrammarRuntime

    config = json.loads((tiny_model_dir / "config.json").read_text())
    vocab = config["vocab_size"]
    # The tokenizer first: the runtime imports transformers on a thread of its own.
    tokenizer = load_tokenizer(tiny_model_dir)
    grammars = GrammarRuntime(str(tiny_model_dir), vocab, [config["eos_token_id"]])
    grammar = grammar_from("regex", "[a-z ]{1,40}")
    params = SamplingParams(temperature=0.0, grammar=grammar)
    batch = InputBatch(max_num_seqs=2, max_model_len=64, max_blocks_per_req=4)
    state = batch._new_state(0, params, 3)
    batch._add_row(state, [1, 2, 3], [1])
    state.matcher = grammars.new_matcher(grammar)
    runner = SimpleNamespace(batch=batch, _grammars=grammars)
    good = tokenizer.encode("ab cd", add_special_tokens=False)
    bad = tokenizer.encode("A", add_special_tokens=False)
    drafts = good + bad + good
    checks = _GrammarChecks(runner, [0], [drafts])
    assert checks.truncated and checks.drafts == [good]
    assert checks.positions == list(range(len(good) + 1))
    assert checks.bitmask.shape[0] == len(good) + 1
    # Rolled back: the matcher still accepts the first draft token, and refuses "A".
    assert state.matcher.validate_tokens(good) == len(good)
    assert state.matcher.validate_tokens(bad) == 0
    index = checks.kept_positions(torch.device("cpu")).tolist()
    assert index == list(range(len(good) + 1))
    checks.accept({0: good[:1]})
    assert state.matcher.validate_tokens(good[1:]) == len(good) - 1


@pytest.mark.parametrize("kind", ["near-target", "far-from-target"])
def test_drafts_sampled_from_a_draft_distribution_keep_the_target_distribution(kind) -> None:
    """A draft model's drafts come from its own q: accepted with min(1, p/q), a rejection drawn
    from max(0, p - q). Chi-square: each emitted token follows p, whatever q is."""
    torch.manual_seed(1)
    logits = torch.randn(3, VOCAB) * 1.5
    params = SamplingParams(temperature=0.8, top_k=5)
    metadata = _metadata([params] * 3)
    targets = [torch.tensor(_target(logits[i], 0.8, 5), dtype=torch.float32) for i in range(2)]
    if kind == "near-target":
        q = torch.stack([(t + 0.05).softmax(dim=-1) * 0.5 + t * 0.5 for t in targets])
    else:
        q = torch.softmax(torch.randn(2, VOCAB) * 2.0, dim=-1)
    num_draws = 6000
    first, second, accepted = [], [], 0
    for seed in range(num_draws):
        generator = torch.Generator().manual_seed(seed)
        drafts = [int(torch.multinomial(q[j], 1, generator=generator)) for j in range(2)]
        tokens = verify(logits, [drafts], metadata, [True], [generator], [None], [q]).token_ids[0]
        first.append(tokens[0])
        if len(tokens) > 1:  # the first draft was accepted: the second position was scored
            accepted += 1
            second.append(tokens[1])
    for observed, position in [(first, 0), (second, 1)]:
        expected = targets[position].double().numpy()
        counts = np.bincount(observed, minlength=VOCAB)
        assert counts[expected == 0].sum() == 0, "a token the filters remove was emitted"
        support = expected > 0
        result = chisquare(counts[support], expected[support] / expected.sum() * len(observed))
        assert result.pvalue > 1e-3, (kind, position, counts, expected * len(observed))
    # The acceptance rate is sum(min(p, q)) at the first position.
    want = float(torch.minimum(targets[0], q[0]).sum())
    assert accepted / num_draws == pytest.approx(want, abs=0.03)


def test_draft_model_proposals_are_its_greedy_continuation_through_accepts_rejects_and_resets(
    tiny_model_dir, hf_model
) -> None:
    """The draft's KV follows the request: after a partial accept (its own draft KV reused up
    to the first wrong draft), a full accept, a new row (a resumed request's new blocks), and
    new rows on blocks the draft filled before (prefix hits: trusted as far as their keys are
    the row's prefix's), its k drafts are the greedy continuation transformers computes from
    the whole history.
    The catch-up runs in chunks (a token budget of 8 for prompts of 21 and 13 tokens), two
    rows batched in every forward."""
    from conveyor.protocol.speculative import SpeculativeConfig
    from conveyor.worker.input_batch import InputBatch
    from conveyor.worker.spec_decode.spec_step import _append

    k = 3
    config = SpeculativeConfig(
        method="draft_model", model=str(tiny_model_dir), **{"num_speculative_tokens": k}
    )
    proposer = _cpu_draft_proposer(config, max_num_tokens=8)
    proposer.initialize_cache(64)
    hf = hf_model(tiny_model_dir)

    def greedy(history: list[int]) -> list[int]:
        ids = torch.tensor([history])
        out = hf.generate(
            ids, max_new_tokens=k, do_sample=False, attention_mask=torch.ones_like(ids)
        )
        return out[0, len(history) :].tolist()

    batch = InputBatch(max_num_seqs=2, max_model_len=128, max_blocks_per_req=32)
    greedy_params = SamplingParams(temperature=0.0)
    histories = [list(range(5, 26)), [7, 3, 9, 11, 400, 3, 9, 11, 400, 3, 9, 11, 77]]
    for req_id, history in enumerate(histories):
        state = batch._new_state(req_id, greedy_params, len(history))
        blocks = list(range(1 + 16 * req_id, 17 + 16 * req_id))
        batch._add_row(state, history, blocks)

    def check() -> list[list[int]]:
        drafts = proposer.propose(batch, [0, 1])
        for row, history in enumerate(histories):
            assert drafts[row] == greedy(history), row
        return drafts

    drafts = check()
    # Row 0 accepts 2 drafts, then its own token; row 1 accepts all k and a bonus token.
    steps = [drafts[0][:2] + [(drafts[0][2] + 1) % 2048], drafts[1] + [5]]
    for row, tokens in enumerate(steps):
        _append(batch, row, tokens)
        histories[row] += tokens
    drafts = check()
    # Row 1 leaves and comes back (preempted, resumed into other blocks): recomputed from 0.
    state = batch.row_states[1]
    old_blocks = batch.block_table[1, :16].tolist()
    batch._remove_rows([1])
    batch._add_row(state, histories[1], list(range(40, 56)))
    assert state.draft_num_computed == 0
    assert proposer._first_unknown(batch, 1) == 0
    check()
    # Back in its old blocks (prefix-cache hits): the draft trusts the blocks it filled with
    # this very prefix, all but the one holding the latest token.
    num_tokens = len(histories[1])
    for history, blocks, trusted in [
        (histories[1], old_blocks, (num_tokens - 1) // 4 * 4),
        # Same blocks, another token in block 2: trusted up to it, and not past it.
        (histories[1][:9] + [histories[1][9] + 1] + histories[1][10:], old_blocks, 8),
    ]:
        batch._remove_rows([1])
        state = batch._new_state(1, greedy_params, len(history))
        batch._add_row(state, history, blocks)
        histories[1] = history
        assert proposer._first_unknown(batch, 1) == trusted
        check()
        old_blocks = batch.block_table[1, :16].tolist()


def test_a_draft_models_worker_pauses_exactly_when_the_engine_drops_its_drafts(
    tiny_model_dir,
) -> None:
    """The engine core's back-off, mirrored in the worker: after two draft steps in a row with
    nothing accepted, the draft model runs no forwards for the steps whose drafts the engine
    would drop, and proposes again in time for the first step that takes drafts."""
    from conveyor.engine_core.request import Request, RequestStatus
    from conveyor.engine_core.spec_decode import SpecDecodeScheduling
    from conveyor.protocol.speculative import SpeculativeConfig
    from conveyor.worker.input_batch import InputBatch
    from conveyor.worker.spec_decode.spec_step import SpecDecoder, _append

    config = SpeculativeConfig(method="draft_model", model=str(tiny_model_dir))
    decoder = SpecDecoder(
        config,
        128,
        lambda: _cpu_draft_proposer(config, max_num_tokens=64),
    )
    decoder.draft.initialize_cache(40)
    batch = InputBatch(max_num_seqs=1, max_model_len=128, max_blocks_per_req=32)
    prompt = list(range(3, 12))
    batch._add_row(
        batch._new_state(0, SamplingParams(temperature=0.0), len(prompt)),
        prompt,
        list(range(1, 33)),
    )
    engine = SpecDecodeScheduling(config)
    request = Request(0, prompt, SamplingParams(temperature=0.0, max_tokens=100), max_model_len=128)
    request.status = RequestStatus.RUNNING
    worker_proposed, engine_took = [], []
    for _ in range(12):
        # The engine schedules the step with the drafts it kept (or none, paused) ...
        drafts = engine.take_drafts(request, 100)
        engine_took.append(bool(drafts))
        # ... the worker verifies them, all rejected, and proposes after its token.
        tokens = {0: [7]}
        if drafts:
            decoder.record_acceptance(batch, [0], tokens)
            engine._back_off(0, 0)
        _append(batch, 0, tokens[0])
        request.append_output_token_id(7)
        proposal = decoder.propose(batch, [0])[0]
        worker_proposed.append(bool(proposal))
        if proposal:
            engine._drafts[0] = (len(request.all_token_ids), proposal)
    # Every proposal made is taken by the next step, and every step that takes drafts had one.
    assert engine_took[1:] == worker_proposed[:-1]
    # Two misses, then 2 steps without; a miss, 4 without: proposals are rare.
    assert worker_proposed == [
        True,
        True,
        False,
        False,
        True,
        False,
        False,
        False,
        False,
        True,
        False,
        False,
    ]


def _cpu_draft_proposer(config, max_num_tokens: int):
    """A draft model proposer for the tiny model on CPU: 128 positions, blocks of 4 tokens,
    float32, the torch attention backend."""
    from conveyor.worker.attention.selector import select_backend
    from conveyor.worker.spec_decode.draft_model import DraftModelProposer

    cpu = torch.device("cpu")
    return DraftModelProposer(
        config,
        max_model_len=128,
        max_num_tokens=max_num_tokens,
        block_size=4,
        vocab_size=2048,
        device=cpu,
        dtype=torch.float32,
        kv_dtype=torch.float32,
        make_backend=lambda sinks: select_backend(cpu, 4, "torch"),
    )
