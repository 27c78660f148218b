"""KVCacheManager: allocation, prefix sharing, the last-token rule, preemption and invariants."""

from __future__ import annotations

import pytest

from conveyor.engine_core.kv_cache_manager import ROOT_BLOCK_HASH, KVCacheManager
from conveyor.engine_core.request import Request
from conveyor.protocol import SamplingParams

BLOCK_SIZE = 4


def make_request(req_id: int, token_ids: list[int]) -> Request:
    return Request(req_id, list(token_ids), SamplingParams(max_tokens=64), max_model_len=4096)


def admit(
    manager: KVCacheManager, request: Request, num_new_tokens: int | None = None
) -> list[int]:
    """What a scheduler does for a waiting request: look up the cache, allocate, advance."""
    hit_ids, num_hit = manager.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - num_hit
    new_ids = manager.allocate_slots(request, num_new_tokens, hit_ids, num_hit)
    assert new_ids is not None
    assert new_ids[: len(hit_ids)] == hit_ids
    request.num_computed_tokens = num_hit + num_new_tokens
    return new_ids


def decode(manager: KVCacheManager, request: Request, token_id: int) -> list[int] | None:
    """One decode step: the sampled token arrives, then one token is scheduled."""
    request.append_output_token_id(token_id)
    new_ids = manager.allocate_slots(request, 1)
    if new_ids is not None:
        request.num_computed_tokens += 1
    return new_ids


def ref_cnt(manager: KVCacheManager, block_id: int) -> int:
    return manager.block_pool.blocks[block_id].ref_cnt


def snapshot(manager: KVCacheManager) -> tuple:
    pool = manager.block_pool
    return (
        manager.num_free_blocks,
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        dict(pool.cached_blocks),
        {req_id: manager.get_block_ids(req_id) for req_id in range(10)},
    )


def test_allocates_ceil_of_tokens_over_block_size():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request(0, list(range(9)))
    new_ids = admit(manager, request)
    assert len(new_ids) == 3
    assert manager.get_block_ids(0) == new_ids
    assert manager.num_free_blocks == 9 - 3
    # Decodes fill the third block before asking for a fourth.
    assert [len(decode(manager, request, 100 + i)) for i in range(4)] == [0, 0, 0, 1]
    assert len(manager.get_block_ids(0)) == 4


def test_chunked_prefill_adds_blocks_chunk_by_chunk():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request(0, list(range(10)))
    assert len(admit(manager, request, num_new_tokens=3)) == 1
    assert len(manager.allocate_slots(request, 5)) == 1
    request.num_computed_tokens += 5
    assert len(manager.allocate_slots(request, 2)) == 1
    assert len(manager.get_block_ids(0)) == 3


def test_reserved_tokens_allocate_up_front():
    manager = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    request = make_request(0, list(range(6)))
    new_ids = manager.allocate_slots(request, 6, num_reserved_tokens=10)
    assert new_ids is not None and len(new_ids) == 4  # ceil(16 / 4)
    request.num_computed_tokens = 6
    for i in range(10):
        assert decode(manager, request, i) == []


def test_shared_prefix_shares_blocks_and_survives_one_free():
    manager = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    prefix = list(range(12))
    first = make_request(0, prefix + [50, 51])
    admit(manager, first)
    second = make_request(1, prefix + [60])
    hit_ids, num_hit = manager.get_computed_blocks(second)
    assert hit_ids == manager.get_block_ids(0)[:3] and num_hit == 12
    admit(manager, second)
    assert [ref_cnt(manager, b) for b in hit_ids] == [2, 2, 2]
    manager.free(first)
    assert [ref_cnt(manager, b) for b in hit_ids] == [1, 1, 1]
    assert manager.get_block_ids(1)[:3] == hit_ids
    manager.free(second)
    manager.check_all_free()
    # Finished requests' full blocks stay cached until evicted.
    third = make_request(2, prefix + [70])
    assert manager.get_computed_blocks(third) == (hit_ids, 12)


def test_a_cache_salt_shares_blocks_only_with_the_same_salt():
    """vLLM's cache_salt: the same prompt under another salt (or none) hits nothing; under the
    same salt it hits as usual."""
    manager = KVCacheManager(num_blocks=40, block_size=BLOCK_SIZE)
    prompt = list(range(13))

    def salted(req_id: int, salt: str | None) -> Request:
        params = SamplingParams(max_tokens=4)
        return Request(req_id, list(prompt), params, max_model_len=4096, cache_salt=salt)

    admit(manager, salted(0, "tenant-a"))
    assert manager.get_computed_blocks(salted(1, "tenant-a"))[1] == 12
    assert manager.get_computed_blocks(salted(2, "tenant-b"))[1] == 0
    assert manager.get_computed_blocks(salted(3, None))[1] == 0
    admit(manager, salted(4, None))
    assert manager.get_computed_blocks(salted(5, None))[1] == 12
    assert manager.get_computed_blocks(salted(6, "tenant-b"))[1] == 0


def test_a_request_for_prompt_logprobs_reads_no_hit_but_its_blocks_are_cached():
    manager = KVCacheManager(num_blocks=40, block_size=BLOCK_SIZE)
    prompt = list(range(13))
    admit(manager, make_request(0, prompt))
    scoring = Request(
        1, list(prompt), SamplingParams(max_tokens=1, prompt_logprobs=0), max_model_len=4096
    )
    assert manager.get_computed_blocks(scoring) == ([], 0)
    admit(manager, scoring)
    assert manager.get_computed_blocks(make_request(3, prompt))[1] == 12


def test_a_different_first_block_breaks_the_chain():
    manager = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    admit(manager, make_request(0, [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Same second block, different first block: the chained hash must not match it.
    other = make_request(1, [9, 9, 9, 9, 5, 6, 7, 8, 9])
    assert manager.get_computed_blocks(other) == ([], 0)


def test_last_token_is_never_taken_from_the_cache():
    manager = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    prompt = list(range(8))  # exactly two full blocks
    first = make_request(0, prompt)
    admit(manager, first)
    manager.free(first)
    again = make_request(1, prompt)
    hit_ids, num_hit = manager.get_computed_blocks(again)
    assert len(hit_ids) == 1 and num_hit == 4
    assert admit(manager, again)[:1] == hit_ids
    assert manager.get_computed_blocks(make_request(2, prompt[:4])) == ([], 0)


def test_failed_allocation_changes_nothing():
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE)
    admit(manager, make_request(0, list(range(8))))
    big = make_request(1, list(range(100, 120)))
    before = snapshot(manager)
    hit_ids, num_hit = manager.get_computed_blocks(big)
    assert manager.allocate_slots(big, 20 - num_hit, hit_ids, num_hit) is None
    assert snapshot(manager) == before
    assert manager.allocate_slots(big, 4, num_reserved_tokens=100) is None
    assert snapshot(manager) == before


def test_hit_blocks_in_the_free_queue_do_not_count_as_free():
    manager = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)  # 4 usable
    first = make_request(0, list(range(12)))
    admit(manager, first)
    manager.free(first)
    assert manager.num_free_blocks == 4
    # 3 cached hits (all in the free queue) + 2 fresh = 5 blocks > 4: must be refused.
    second = make_request(1, list(range(12)) + list(range(100, 108)))
    hit_ids, num_hit = manager.get_computed_blocks(second)
    assert len(hit_ids) == 3
    before = snapshot(manager)
    assert manager.allocate_slots(second, second.num_tokens - num_hit, hit_ids, num_hit) is None
    assert snapshot(manager) == before


def test_free_is_idempotent_and_releases_tail_first():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request(0, list(range(12)))
    block_ids = admit(manager, request)
    manager.free(request)
    manager.free(request)
    manager.check_all_free()
    queue = [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]
    # The request's last block is evicted first, its first block last.
    assert queue[-3:] == block_ids[::-1]


def test_lru_evicts_the_tail_of_a_finished_request_first():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)  # 3 usable
    first = make_request(0, list(range(13)))
    admit(manager, first, num_new_tokens=12)
    manager.free(first)
    filler = make_request(1, [99])
    admit(manager, filler)
    # One block was reused: the third one; the first two still hit.
    again = make_request(2, list(range(13)))
    assert manager.get_computed_blocks(again)[1] == 8


def test_preempted_request_hits_its_own_blocks_again():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request(0, list(range(10)))
    admit(manager, request)
    for token_id in (20, 21, 22):
        decode(manager, request, token_id)
    assert request.num_computed_tokens == 13
    manager.free(request)
    request.num_computed_tokens = 0
    request.append_output_token_id(23)
    hit_ids, num_hit = manager.get_computed_blocks(request)
    assert num_hit == 12  # 3 full blocks of prompt + outputs; the 14th token is recomputed
    new_ids = admit(manager, request)
    assert new_ids[:3] == hit_ids and len(new_ids) == 4


def test_blocks_registered_but_never_computed_are_dropped_on_free():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request(0, list(range(9)))
    # Allocated (registering 2 full blocks) and then preempted before the step was counted.
    assert manager.allocate_slots(request, 9) is not None
    assert len(manager.block_pool.cached_blocks) == 2
    manager.free(request)
    assert manager.block_pool.cached_blocks == {}
    assert manager.get_computed_blocks(make_request(1, list(range(9)))) == ([], 0)


def test_decode_registers_a_block_when_it_fills():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request(0, [1, 2, 3, 4, 5])
    admit(manager, request)
    assert len(manager.block_pool.cached_blocks) == 1
    for token_id in (6, 7):
        decode(manager, request, token_id)
    assert len(manager.block_pool.cached_blocks) == 1
    decode(manager, request, 8)
    assert len(manager.block_pool.cached_blocks) == 2
    follower = make_request(1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert manager.get_computed_blocks(follower) == (manager.get_block_ids(0)[:2], 8)


def test_block_hashes_chain_from_the_root():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request(0, list(range(9)))
    admit(manager, request)
    h0 = manager.hash_block(ROOT_BLOCK_HASH, [0, 1, 2, 3])
    h1 = manager.hash_block(h0, [4, 5, 6, 7])
    cached = manager.block_pool.cached_blocks
    assert [cached[h0].block_id, cached[h1].block_id] == manager.get_block_ids(0)[:2]
    assert manager.hash_block(ROOT_BLOCK_HASH, [4, 5, 6, 7]) != h1


def test_stale_computed_blocks_are_refused():
    manager = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE)  # 2 usable
    first = make_request(0, list(range(5)))
    admit(manager, first)
    manager.free(first)
    second = make_request(1, list(range(5)))
    hit_ids, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 4
    # Another allocation evicts the hit before it is used.
    admit(manager, make_request(2, list(range(100, 108))))
    with pytest.raises(AssertionError, match="no longer holds"):
        manager.allocate_slots(second, 1, hit_ids, num_hit)


def test_caching_off_hashes_nothing_and_hits_nothing():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    first = make_request(0, list(range(9)))
    admit(manager, first)
    manager.free(first)
    assert manager.block_pool.cached_blocks == {}
    assert manager.get_computed_blocks(make_request(1, list(range(9)))) == ([], 0)
    assert manager.prefix_cache_queries == 0 and manager.prefix_cache_hits == 0
    manager.check_all_free()


def test_prefix_cache_stats_count_tokens():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    first = make_request(0, list(range(9)))
    admit(manager, first)
    admit(manager, make_request(1, list(range(10))))
    assert manager.prefix_cache_queries == 19
    assert manager.prefix_cache_hits == 8


def test_usage_is_the_fraction_of_usable_blocks_held():
    manager = KVCacheManager(num_blocks=9, block_size=BLOCK_SIZE)  # 8 usable
    assert manager.usage == 0.0
    request = make_request(0, list(range(8)))
    admit(manager, request)
    assert manager.usage == pytest.approx(0.25)
    manager.free(request)
    assert manager.usage == 0.0


def test_reset_prefix_cache_refuses_while_blocks_are_in_use():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request(0, list(range(9)))
    admit(manager, request)
    assert manager.reset_prefix_cache() is False
    assert len(manager.block_pool.cached_blocks) == 2
    manager.free(request)
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(make_request(1, list(range(9)))) == ([], 0)


def test_check_all_free_names_requests_that_still_hold_blocks():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request(7, list(range(3)))
    admit(manager, request)
    with pytest.raises(AssertionError, match=r"req_ids \[7\]"):
        manager.check_all_free()
    manager.free(request)
    manager.check_all_free()


def test_a_sliding_window_frees_the_blocks_wholly_behind_it():
    # Window 6, blocks of 4: a query at position p sees p - 5 .. p.
    manager = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE, sliding_window=6)
    request = make_request(0, list(range(1, 14)))  # 13 tokens: blocks 0..3
    first_ids = admit(manager, request)
    assert len(first_ids) == 4 and manager.num_free_blocks == 19 - 4
    # The next query is at 13 and sees 8..13: blocks 0 and 1 (positions 0..7) are behind it.
    decode(manager, request, 50)
    assert manager.get_block_ids(0) == [0, 0, *first_ids[2:]]
    assert manager.num_window_freed_blocks == 2
    assert manager.num_free_blocks == 19 - 2
    # Both were full and computed: they stay in the prefix cache while free.
    cached = manager.block_pool.cached_blocks
    assert {cached[h].block_id for h in manager._requests[0].block_hashes[:2]} == set(first_ids[:2])
    for token in range(51, 56):
        decode(manager, request, token)
    # Next query at 19 sees 14..19: blocks 0..2 behind, block 3 (12..15) still in view.
    assert manager.get_block_ids(0)[:4] == [0, 0, 0, first_ids[3]]
    manager.free(request)
    manager.check_all_free()


def test_blocks_freed_behind_a_window_are_still_prefix_hits_until_evicted():
    manager = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE, sliding_window=3)
    prompt = list(range(1, 18))  # 17 tokens: four full blocks
    first = make_request(0, prompt)
    first_ids = admit(manager, first)
    decode(manager, first, 99)
    assert manager.get_block_ids(0)[:3] == [0, 0, 0]
    second = make_request(1, prompt)
    hit_ids, num_hit = manager.get_computed_blocks(second)
    assert hit_ids == first_ids[:4] and num_hit == 16
    admit(manager, second)
    assert manager.get_block_ids(1)[:4] == first_ids[:4]
    manager.free(first)
    manager.free(second)
    manager.check_all_free()


def test_without_a_window_nothing_is_freed_while_running():
    manager = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    request = make_request(0, list(range(1, 30)))
    ids = admit(manager, request)
    for token in range(40, 50):
        decode(manager, request, token)
    assert manager.get_block_ids(0)[: len(ids)] == ids
    assert manager.num_window_freed_blocks == 0


def test_a_window_must_be_positive():
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE, sliding_window=0)
