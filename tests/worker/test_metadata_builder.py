"""build_attention_metadata: a hand-checked step, and positions/slots against the block table."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.worker.attention.metadata_builder import build_attention_metadata

CPU = torch.device("cpu")


def test_hand_checked_step():
    # Request 0: a fresh 3-token prompt in block 7. Request 1: a decode at position 5, the
    # second token of its second block (9). Request 2: a prompt chunk at positions 3..6,
    # crossing from block 1 into block 4.
    block_table = np.array([[7, 2, 0], [3, 9, 0], [1, 4, 0]], dtype=np.int32)
    metadata, positions = build_attention_metadata(
        np.array([3, 1, 4], dtype=np.int32),
        np.array([0, 5, 3], dtype=np.int32),
        block_table,
        block_size=4,
        device=CPU,
    )
    assert positions.tolist() == [0, 1, 2, 5, 3, 4, 5, 6]
    assert metadata.slot_mapping.tolist() == [28, 29, 30, 37, 7, 16, 17, 18]
    assert metadata.slot_mapping.dtype == torch.int64
    assert metadata.query_start_loc.tolist() == [0, 3, 4, 8]
    assert metadata.query_start_loc.dtype == torch.int32
    assert metadata.seq_lens.tolist() == [3, 6, 7]
    assert metadata.seq_lens.dtype == torch.int32
    assert metadata.block_table.tolist() == block_table.tolist()
    assert metadata.block_table.dtype == torch.int32
    assert (metadata.num_actual_tokens, metadata.max_query_len, metadata.max_seq_len) == (8, 4, 7)
    assert metadata.query_start_loc_cpu.tolist() == [0, 3, 4, 8]
    assert metadata.seq_lens_cpu.tolist() == [3, 6, 7]
    assert metadata.num_reqs == 3


def test_block_table_is_copied_so_the_runner_may_keep_editing_its_own():
    table = np.array([[1, 2]], dtype=np.int32)
    metadata, _ = build_attention_metadata(
        np.array([2], np.int32), np.array([0], np.int32), table, 4, CPU
    )
    table[0, 0] = 99
    assert metadata.block_table.tolist() == [[1, 2]]


def test_a_position_beyond_the_block_table_is_an_error():
    with pytest.raises(ValueError, match="block table has 2 columns"):
        build_attention_metadata(
            np.array([2], np.int32), np.array([7], np.int32), np.zeros((1, 2), np.int32), 4, CPU
        )


@st.composite
def steps(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    num_reqs = draw(st.integers(1, 6))
    computed = draw(st.lists(st.integers(0, 40), min_size=num_reqs, max_size=num_reqs))
    scheduled = draw(st.lists(st.integers(1, 20), min_size=num_reqs, max_size=num_reqs))
    width = max(-(-(c + s) // block_size) for c, s in zip(computed, scheduled))
    # Distinct block ids across all requests, in a scrambled order.
    ids = draw(st.permutations(range(num_reqs * width)))
    table = np.array(ids, dtype=np.int32).reshape(num_reqs, width)
    return block_size, np.array(computed, np.int32), np.array(scheduled, np.int32), table


@settings(max_examples=60, deadline=None)
@given(steps())
def test_positions_and_slots_follow_each_requests_block_table(step):
    block_size, computed, scheduled, table = step
    metadata, positions = build_attention_metadata(scheduled, computed, table, block_size, CPU)
    slots = metadata.slot_mapping.numpy()
    starts = metadata.query_start_loc_cpu
    assert starts[-1] == len(positions) == len(slots) == metadata.num_actual_tokens
    for i in range(len(scheduled)):
        own = slice(starts[i], starts[i + 1])
        expected = np.arange(computed[i], computed[i] + scheduled[i])
        np.testing.assert_array_equal(positions[own], expected)
        np.testing.assert_array_equal(slots[own] // block_size, table[i, expected // block_size])
        np.testing.assert_array_equal(slots[own] % block_size, expected % block_size)
    assert len(set(slots.tolist())) == len(slots)  # distinct blocks never share a slot
    np.testing.assert_array_equal(metadata.seq_lens_cpu, computed + scheduled)
    assert metadata.max_seq_len == int((computed + scheduled).max())
    assert metadata.max_query_len == int(scheduled.max())
