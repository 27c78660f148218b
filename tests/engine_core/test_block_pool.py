"""BlockPool and FreeBlockQueue: LRU order, O(1) removal, ref counts, the hash index."""

from __future__ import annotations

import random
import time

import pytest

from conveyor.engine_core.block_pool import NULL_BLOCK_ID, BlockPool, FreeBlockQueue, KVCacheBlock


def _ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def _queue_ids(pool: BlockPool) -> list[int]:
    return _ids(pool.free_block_queue.get_all_free_blocks())


# ---------------------------------------------------------------- FreeBlockQueue


def test_queue_pops_in_append_order_and_removes_from_the_middle():
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeBlockQueue(blocks)
    assert len(queue) == 6
    queue.remove(blocks[3])
    queue.remove(blocks[0])  # the head
    queue.remove(blocks[5])  # the tail
    assert _ids(queue.get_all_free_blocks()) == [1, 2, 4]
    assert len(queue) == 3
    assert blocks[3].prev_free is None and blocks[3].next_free is None
    queue.append(blocks[3])
    assert [queue.popleft().block_id for _ in range(4)] == [1, 2, 4, 3]
    assert len(queue) == 0
    with pytest.raises(IndexError):
        queue.popleft()


def test_queue_refuses_to_remove_a_block_it_does_not_hold():
    held = KVCacheBlock(7)
    queue = FreeBlockQueue([KVCacheBlock(0)])
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(held)
    assert len(queue) == 1


def test_queue_middle_removal_does_not_scan_the_queue():
    # 40k removals in random order: O(1) each is a few ms; a scan per removal would be ~8e8 steps.
    blocks = [KVCacheBlock(i) for i in range(40_000)]
    queue = FreeBlockQueue(blocks)
    order = list(range(40_000))
    random.Random(0).shuffle(order)
    start = time.perf_counter()
    for i in order[:20_000]:
        queue.remove(blocks[i])
    elapsed = time.perf_counter() - start
    assert len(queue) == 20_000
    assert _ids(queue.get_all_free_blocks()) == sorted(order[20_000:])
    assert elapsed < 1.0, f"20k middle removals took {elapsed:.2f} s"


# ---------------------------------------------------------------- BlockPool


def test_block_zero_is_reserved_and_never_handed_out():
    pool = BlockPool(num_blocks=5, enable_caching=True)
    assert pool.num_usable_blocks == 4
    assert pool.num_free_blocks == 4
    taken = pool.get_new_blocks(4)
    assert NULL_BLOCK_ID not in _ids(taken)
    assert sorted(_ids(taken)) == [1, 2, 3, 4]
    assert pool.num_free_blocks == 0
    assert pool.usage == 1.0


def test_pool_needs_one_usable_block():
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(num_blocks=1, enable_caching=True)


def test_get_new_blocks_takes_from_the_head_with_one_ref():
    pool = BlockPool(num_blocks=6, enable_caching=True)
    taken = pool.get_new_blocks(2)
    assert _ids(taken) == [1, 2]
    assert all(b.ref_cnt == 1 for b in taken)
    assert _queue_ids(pool) == [3, 4, 5]


def test_asking_for_too_many_blocks_changes_nothing():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    with pytest.raises(ValueError, match="only 3 free"):
        pool.get_new_blocks(4)
    assert pool.num_free_blocks == 3
    assert _queue_ids(pool) == [1, 2, 3]


def test_freed_blocks_join_the_tail_so_the_least_recently_freed_is_reused_first():
    pool = BlockPool(num_blocks=6, enable_caching=True)
    a, b, c, d, e = pool.get_new_blocks(5)
    pool.free_blocks([c, a])
    pool.free_blocks([e])
    assert _queue_ids(pool) == [3, 1, 5]
    assert _ids(pool.get_new_blocks(2)) == [3, 1]


def test_lru_evicts_the_oldest_cached_block_and_drops_its_hash():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    a, b, c = pool.get_new_blocks(3)
    for block, h in ((a, b"a"), (b, b"b"), (c, b"c")):
        assert pool.cache_full_block(block, h)
    pool.free_blocks([b, a, c])  # b freed first: least recently used
    (reused,) = pool.get_new_blocks(1)
    assert reused is b
    assert reused.block_hash is None
    assert pool.get_cached_block(b"b") is None
    assert pool.get_cached_block(b"a") is a and pool.get_cached_block(b"c") is c


def test_touch_takes_a_cached_free_block_out_of_the_queue():
    pool = BlockPool(num_blocks=5, enable_caching=True)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_block(b, b"hb")
    pool.free_blocks([c, b, a])
    hit = pool.get_cached_block(b"hb")
    assert hit is b
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert _queue_ids(pool) == [4, 3, 1]
    pool.touch([hit])  # a second holder: no queue change
    assert hit.ref_cnt == 2
    pool.free_blocks([hit])
    assert hit.ref_cnt == 1 and 2 not in _queue_ids(pool)
    pool.free_blocks([hit])
    assert _queue_ids(pool) == [4, 3, 1, 2]


def test_freeing_a_block_nobody_holds_raises():
    pool = BlockPool(num_blocks=3, enable_caching=True)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(AssertionError, match="nobody holds"):
        pool.free_blocks([a])


def test_a_hash_is_indexed_once():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_full_block(a, b"same")
    assert not pool.cache_full_block(b, b"same")
    assert b.block_hash is None
    # Evicting the copy that is not indexed must not drop the indexed one.
    pool.free_blocks([b])
    pool.get_new_blocks(2)
    assert pool.get_cached_block(b"same") is a


def test_caching_off_indexes_nothing():
    pool = BlockPool(num_blocks=3, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    assert not pool.cache_full_block(a, b"h")
    assert a.block_hash is None and pool.get_cached_block(b"h") is None


def test_usage_counts_held_blocks_only():
    pool = BlockPool(num_blocks=5, enable_caching=True)
    assert pool.usage == 0.0
    a, b, _ = pool.get_new_blocks(3)
    assert pool.usage == pytest.approx(0.75)
    pool.cache_full_block(a, b"h")
    pool.free_blocks([a, b])
    assert pool.usage == pytest.approx(0.25)  # a cached free block counts as free


def test_reset_prefix_cache_refuses_while_blocks_are_held():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, b"ha")
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(b"ha") is a
    pool.free_blocks([b, a])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(b"ha") is None and a.block_hash is None
    pool.check_all_free()


def test_check_all_free_names_the_held_blocks():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    pool.check_all_free()
    a, b = pool.get_new_blocks(2)
    with pytest.raises(AssertionError, match=r"2 blocks still have holders: ids \[1, 2\]"):
        pool.check_all_free()
    pool.free_blocks([b, a])
    pool.check_all_free()


def test_check_all_free_catches_a_block_lost_from_the_queue():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    (a,) = pool.get_new_blocks(1)
    a.ref_cnt = 0  # corrupted bookkeeping: no holder, yet not back in the queue
    with pytest.raises(AssertionError, match=r"missing ids \[1\]"):
        pool.check_all_free()
