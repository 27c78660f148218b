"""The runner's step inputs: staged into buffers that outlive a step, equal to a fresh build, and
the block table mirrored row by row from each diff (CPU here; the same code runs on CUDA)."""

from __future__ import annotations

import numpy as np
import torch

from conveyor.protocol import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from conveyor.worker.attention.metadata_builder import build_attention_metadata
from conveyor.worker.device_buffers import StagingBuffer
from conveyor.worker.input_batch import InputBatch
from conveyor.worker.step_inputs import StepInputBuffers

CPU = torch.device("cpu")
BLOCK = 4
GREEDY = SamplingParams(temperature=0.0)


def _new(req_id: int, num_prompt: int, blocks: list[int], scheduled: int) -> NewRequestData:
    prompt = list(range(10 * req_id + 3, 10 * req_id + 3 + num_prompt))
    return NewRequestData(req_id, prompt, GREEDY, blocks, 0, scheduled)


def _cached(entries, resumed=None) -> CachedRequestData:
    """entries: (req_id, new block ids, num_computed, num_scheduled)."""
    return CachedRequestData(
        req_ids=[e[0] for e in entries],
        new_block_ids=[e[1] for e in entries],
        num_computed_tokens=[e[2] for e in entries],
        num_scheduled_tokens=[e[3] for e in entries],
        resumed_token_ids=resumed or {},
    )


def _check_against_fresh_build(buffers: StepInputBuffers, batch: InputBatch) -> None:
    rows = batch.scheduled_rows()
    inputs = buffers.prepare(batch, rows, BLOCK)
    scheduled = batch.num_scheduled_tokens[rows]
    computed = batch.num_computed_tokens[rows]
    expected, positions = build_attention_metadata(
        scheduled, computed, batch.block_table[rows], BLOCK, CPU
    )
    got = inputs.metadata
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_table"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    assert got.num_actual_tokens == expected.num_actual_tokens
    assert (got.max_query_len, got.max_seq_len) == (expected.max_query_len, expected.max_seq_len)
    assert torch.equal(inputs.positions, torch.from_numpy(positions))
    token_rows = np.repeat(rows, scheduled)
    assert inputs.input_ids.tolist() == batch.token_ids[token_rows, positions].tolist()
    ends = np.cumsum(scheduled) - 1
    samples = computed + scheduled >= batch.num_tokens[rows]
    assert inputs.logits_indices.tolist() == ends[samples].tolist()
    assert inputs.sampling_rows.tolist() == rows[samples].tolist()


def _check_mirror(buffers: StepInputBuffers, batch: InputBatch) -> None:
    live = batch.block_table[: batch.num_reqs]
    assert torch.equal(buffers.block_table.table[: batch.num_reqs], torch.from_numpy(live))


def test_staged_inputs_equal_a_fresh_build_step_after_step():
    batch = InputBatch(max_num_seqs=6, max_model_len=32, max_blocks_per_req=8)
    buffers = StepInputBuffers(batch, max_num_tokens=64, device=CPU, mirror_block_table=True)
    steps = [
        # Two whole prompts and a first chunk of a third (it does not sample).
        SchedulerOutput(1, [_new(0, 5, [1, 2], 5), _new(1, 9, [3, 4, 5], 9), _new(2, 12, [6], 4)]),
        # Decodes, and the chunked prompt goes on with a new block.
        SchedulerOutput(2, scheduled_cached_reqs=_cached([(0, [], 5, 1), (1, [], 9, 1), (2, [7, 8, 14], 4, 8)])),
        # Only rows 0 and 2 run (row 1 sits out): the table is gathered, not sliced.
        SchedulerOutput(3, scheduled_cached_reqs=_cached([(0, [], 6, 1), (2, [], 12, 1)])),
        # Request 0 finishes: the last row moves into its place.
        SchedulerOutput(4, scheduled_cached_reqs=_cached([(1, [9], 10, 1), (2, [], 13, 1)]), finished_req_ids=[0]),
        # Request 1 is preempted, then resumed on other blocks with its history recomputed.
        SchedulerOutput(5, scheduled_cached_reqs=_cached([(2, [10], 14, 1)]), preempted_req_ids=[1]),
    ]  # fmt: skip
    for step in steps:
        batch.apply(step)
        _check_against_fresh_build(buffers, batch)
        _check_mirror(buffers, batch)
        batch.append_sampled(batch.scheduled_rows(), np.full(len(batch.scheduled_rows()), 7))
    assert 1 in batch.states and 1 not in batch.row_of
    resumed_tokens = list(range(13, 24))
    batch.apply(
        SchedulerOutput(
            6,
            scheduled_cached_reqs=_cached(
                [(2, [], 15, 1), (1, [11, 12, 13], 0, 11)], resumed={1: resumed_tokens}
            ),
        )
    )
    _check_against_fresh_build(buffers, batch)
    _check_mirror(buffers, batch)


def test_only_rows_a_diff_touched_are_copied_to_the_mirror():
    batch = InputBatch(max_num_seqs=4, max_model_len=32, max_blocks_per_req=8)
    batch.apply(SchedulerOutput(1, [_new(0, 5, [1, 2], 5), _new(1, 5, [3, 4], 5)]))
    assert batch.take_changed_block_rows().tolist() == [0, 1]
    batch.apply(SchedulerOutput(2, scheduled_cached_reqs=_cached([(0, [], 5, 1), (1, [], 5, 1)])))
    assert batch.take_changed_block_rows().tolist() == []
    batch.apply(SchedulerOutput(3, scheduled_cached_reqs=_cached([(0, [], 6, 1), (1, [5], 6, 1)])))
    assert batch.take_changed_block_rows().tolist() == [1]
    batch.apply(SchedulerOutput(4, finished_req_ids=[0]))  # row 1 moves to row 0
    assert batch.take_changed_block_rows().tolist() == [0]


def test_without_a_mirror_the_cpu_table_is_the_batchs_own_array():
    batch = InputBatch(max_num_seqs=4, max_model_len=32, max_blocks_per_req=8)
    buffers = StepInputBuffers(batch, max_num_tokens=64, device=CPU)
    batch.apply(SchedulerOutput(1, [_new(0, 5, [1, 2], 5)]))
    buffers.prepare(batch, batch.scheduled_rows(), BLOCK)
    batch.block_table[0, 3] = 42
    assert buffers.block_table.table[0, 3] == 42


def test_a_staging_buffer_too_small_for_a_step_still_returns_the_values():
    buffer = StagingBuffer(4, torch.int64, CPU)
    assert buffer.stage(np.arange(3)).tolist() == [0, 1, 2]
    assert buffer.stage(np.arange(6)).tolist() == [0, 1, 2, 3, 4, 5]


def test_a_decode_step_a_whole_graph_replays_is_padded_in_the_fixed_buffers():
    # What a whole-forward graph of 8 reads: the step's requests, then padding requests that
    # read no key and write nothing to the cache (one query token each, no context, slot -1),
    # and the step's table rows in its own table.
    batch = InputBatch(max_num_seqs=8, max_model_len=32, max_blocks_per_req=8)
    buffers = StepInputBuffers(batch, max_num_tokens=64, device=CPU, mirror_block_table=True)
    batch.apply(SchedulerOutput(1, [_new(0, 5, [1, 2], 5), _new(1, 9, [3, 4, 5], 9), _new(2, 2, [6], 2)]))  # fmt: skip
    buffers.prepare(batch, batch.scheduled_rows(), BLOCK, lambda n: 8)  # prompts: never padded
    assert buffers.graph_block_table is None
    batch.append_sampled(batch.scheduled_rows(), np.full(3, 7))
    captured = buffers.graph_metadata(8)  # what the graph was captured on
    assert captured.seq_lens.tolist() == [0] * 8 and captured.slot_mapping.tolist() == [-1] * 8
    batch.apply(SchedulerOutput(2, scheduled_cached_reqs=_cached([(0, [], 5, 1), (2, [], 2, 1)])))
    rows = batch.scheduled_rows()
    buffers.graph_block_table.fill_(99)
    inputs = buffers.prepare(batch, rows, BLOCK, lambda n: 8 if n <= 8 else None)
    # The step's own metadata is the unpadded one: eager and piecewise steps read it.
    assert inputs.metadata.seq_lens.tolist() == [6, 3]
    assert inputs.metadata.slot_mapping.tolist() == [2 * BLOCK + 1, 6 * BLOCK + 2]
    assert inputs.metadata.query_start_loc.tolist() == [0, 1, 2]
    # The fixed buffers behind it, at the addresses the graph read when it was captured.
    assert buffers.seq_lens.host[:8].tolist() == [6, 3, 0, 0, 0, 0, 0, 0]
    assert buffers.slot_mapping.host[:8].tolist() == [9, 26, -1, -1, -1, -1, -1, -1]
    assert buffers.query_start_loc.host[:9].tolist() == list(range(9))
    assert captured.seq_lens.data_ptr() == buffers.seq_lens.device_tensor.data_ptr()
    assert captured.block_table.data_ptr() == buffers.graph_block_table.data_ptr()
    expected = torch.from_numpy(batch.block_table[rows])
    assert torch.equal(inputs.metadata.block_table, expected)
    # Only the columns the contexts reach (6 tokens: 2 blocks of 4); the rest is never read.
    assert torch.equal(buffers.graph_block_table[:2, :2], expected[:, :2])
    assert (buffers.graph_block_table[:2, 2:] == 99).all()
    # Without whole graphs nothing past the step is touched.
    buffers.seq_lens.host[:8] = 99
    buffers.prepare(batch, rows, BLOCK)
    assert buffers.seq_lens.host[:8].tolist() == [6, 3, 99, 99, 99, 99, 99, 99]
