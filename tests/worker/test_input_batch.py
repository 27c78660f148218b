"""The persistent batch folds hand-made SchedulerOutput diffs in place (no model, no torch)."""

from __future__ import annotations

import numpy as np
import pytest

from conveyor.protocol import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from conveyor.worker.input_batch import InputBatch

GREEDY = SamplingParams(temperature=0.0)


def _new(req_id: int, prompt: list[int], blocks: list[int], computed: int = 0, scheduled=None):
    scheduled = len(prompt) - computed if scheduled is None else scheduled
    return NewRequestData(req_id, prompt, GREEDY, blocks, computed, scheduled)


def _cached(*entries, resumed=None) -> CachedRequestData:
    """entries: (req_id, new_block_ids, num_computed, num_scheduled)."""
    return CachedRequestData(
        req_ids=[e[0] for e in entries],
        new_block_ids=[e[1] for e in entries],
        num_computed_tokens=[e[2] for e in entries],
        num_scheduled_tokens=[e[3] for e in entries],
        resumed_token_ids=resumed or {},
    )


def _row_tokens(batch: InputBatch, req_id: int) -> list[int]:
    row = batch.row_of[req_id]
    return batch.token_ids[row, : batch.num_tokens[row]].tolist()


def _row_blocks(batch: InputBatch, req_id: int) -> list[int]:
    row = batch.row_of[req_id]
    return batch.block_table[row, : batch.num_blocks[row]].tolist()


@pytest.fixture
def batch() -> InputBatch:
    return InputBatch(max_num_seqs=4, max_model_len=32, max_blocks_per_req=8)


def test_new_requests_fill_rows_in_order(batch):
    batch.apply(SchedulerOutput(1, [_new(7, [1, 2, 3], [1]), _new(9, [4, 5], [2], scheduled=1)]))
    assert batch.num_reqs == 2 and batch.req_ids == [7, 9]
    assert _row_tokens(batch, 7) == [1, 2, 3] and _row_blocks(batch, 9) == [2]
    assert batch.num_scheduled_tokens[:2].tolist() == [3, 1]
    rows = batch.scheduled_rows()
    # Request 9 is mid-prefill (1 of 2 tokens): only request 7 samples.
    assert batch.sampling_rows(rows).tolist() == [batch.row_of[7]]


def test_cached_diff_appends_blocks_and_sets_counters_in_place(batch):
    batch.apply(SchedulerOutput(1, [_new(7, [1, 2, 3, 4], [5])]))
    token_array = batch.token_ids
    batch.append_sampled(np.array([0]), np.array([42]))
    batch.apply(SchedulerOutput(2, scheduled_cached_reqs=_cached((7, [6], 4, 1))))
    assert batch.token_ids is token_array  # updated, not rebuilt
    assert _row_tokens(batch, 7) == [1, 2, 3, 4, 42]
    assert _row_blocks(batch, 7) == [5, 6]
    assert batch.block_table[0, 2:].tolist() == [0] * 6
    assert batch.num_computed_tokens[0] == 4 and batch.num_scheduled_tokens[0] == 1
    assert batch.sampling_rows(batch.scheduled_rows()).tolist() == [0]


def test_unscheduled_rows_are_skipped_but_kept(batch):
    batch.apply(SchedulerOutput(1, [_new(1, [1, 2], [1]), _new(2, [3, 4], [2])]))
    batch.append_sampled(np.array([0, 1]), np.array([10, 20]))
    batch.apply(SchedulerOutput(2, scheduled_cached_reqs=_cached((2, [], 2, 1))))
    assert batch.num_reqs == 2
    assert batch.scheduled_rows().tolist() == [batch.row_of[2]]


def test_finish_condenses_by_moving_the_last_row(batch):
    prompts = {r: [r * 10 + i for i in range(r)] for r in (1, 2, 3, 4)}
    batch.apply(SchedulerOutput(1, [_new(r, p, [r]) for r, p in prompts.items()]))
    batch.append_sampled(np.arange(4), np.array([101, 102, 103, 104]))
    batch.apply(
        SchedulerOutput(
            2,
            scheduled_cached_reqs=_cached((2, [], 2, 1), (4, [9], 4, 1)),
            finished_req_ids=[1, 3],
        )
    )
    assert batch.num_reqs == 2 and set(batch.req_ids) == {2, 4}
    assert batch.row_of == {rid: row for row, rid in enumerate(batch.req_ids)}
    assert batch.req_ids[0] == 4  # the last row moved into the first hole
    assert _row_tokens(batch, 4) == prompts[4] + [104]
    assert _row_tokens(batch, 2) == prompts[2] + [102]
    assert _row_blocks(batch, 4) == [4, 9] and _row_blocks(batch, 2) == [2]
    assert 1 not in batch.states and 3 not in batch.states


def test_finish_of_the_tail_rows_needs_no_move(batch):
    batch.apply(SchedulerOutput(1, [_new(r, [r], [r]) for r in (1, 2, 3)]))
    batch.apply(SchedulerOutput(2, finished_req_ids=[2, 3]))
    assert batch.req_ids == [1] and batch.row_of == {1: 0}


def test_preempt_keeps_state_and_resume_replaces_history(batch):
    seeded = SamplingParams(temperature=1.0, seed=5)
    made: list[int] = []
    batch = InputBatch(4, 32, 8, make_generator=lambda seed: made.append(seed) or object())
    batch.apply(SchedulerOutput(1, [NewRequestData(3, [1, 2, 3], seeded, [1], 0, 3)]))
    generator = batch.states[3].generator
    batch.append_sampled(np.array([0]), np.array([50]))
    batch.apply(SchedulerOutput(2, preempted_req_ids=[3]))
    assert batch.num_reqs == 0 and 3 in batch.states
    resumed = _cached((3, [7, 8], 0, 4), resumed={3: [1, 2, 3, 50]})
    batch.apply(SchedulerOutput(3, scheduled_cached_reqs=resumed))
    assert _row_tokens(batch, 3) == [1, 2, 3, 50]
    assert _row_blocks(batch, 3) == [7, 8]
    assert batch.states[3].generator is generator and made == [5]
    assert batch.output_token_ids(0).tolist() == [50]
    assert batch.prompt_token_ids(0).tolist() == [1, 2, 3]
    assert batch.sampling_rows(batch.scheduled_rows()).tolist() == [0]


def test_finished_while_preempted_drops_the_mirror(batch):
    batch.apply(SchedulerOutput(1, [_new(3, [1, 2], [1])]))
    batch.apply(SchedulerOutput(2, preempted_req_ids=[3]))
    batch.apply(SchedulerOutput(3, finished_req_ids=[3]))
    assert batch.states == {} and batch.num_reqs == 0


def test_rows_stay_consistent_under_random_churn():
    rng = np.random.default_rng(0)
    batch = InputBatch(8, 64, 16)
    expected: dict[int, list[int]] = {}
    next_id = 0
    for step in range(200):
        finished = [r for r in expected if rng.random() < 0.2]
        for r in finished:
            del expected[r]
        new = []
        while len(expected) < 8 and rng.random() < 0.5:
            prompt = rng.integers(0, 1000, rng.integers(1, 10)).tolist()
            new.append(_new(next_id, prompt, [next_id % 50 + 1]))
            expected[next_id] = list(prompt)
            next_id += 1
        new_ids = {n.req_id for n in new}
        cached = [(r, [], len(t) - 1, 1) for r, t in expected.items() if r not in new_ids]
        batch.apply(SchedulerOutput(step, new, _cached(*cached), finished_req_ids=finished))
        rows = batch.sampling_rows(batch.scheduled_rows())
        sampled = rng.integers(0, 1000, len(rows))
        batch.append_sampled(rows, sampled)
        for row, token in zip(rows.tolist(), sampled.tolist()):
            expected[batch.req_ids[row]].append(token)
        if any(len(t) > 60 for t in expected.values()):
            expected_long = [r for r, t in expected.items() if len(t) > 60]
            batch.apply(SchedulerOutput(step, finished_req_ids=expected_long))
            for r in expected_long:
                del expected[r]
        assert batch.num_reqs == len(expected)
        assert {r: _row_tokens(batch, r) for r in expected} == expected
