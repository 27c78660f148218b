"""Property test: KVCacheManager driven like a scheduler, with its invariants after every op.

Random requests drawn from a few shared prefixes are admitted (prefix hits, random chunks,
reservations), stepped (chunked prefill, decode tokens appended), preempted (also right after an
allocation that never got computed) and finished, over a pool small enough to run out.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from conveyor.engine_core.kv_cache_manager import ROOT_BLOCK_HASH, KVCacheManager
from conveyor.engine_core.request import Request
from conveyor.protocol import SamplingParams

BLOCK_SIZE = 4


def make_request(req_id: int, token_ids: list[int]) -> Request:
    return Request(req_id, list(token_ids), SamplingParams(max_tokens=64), max_model_len=4096)


# A few shared prefixes over a tiny vocabulary, so prompts share blocks and collide often.
PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 12)


class KVCacheMachine(RuleBasedStateMachine):
    """Drives the manager like a scheduler would, over a pool small enough to run out."""

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
        self.waiting: dict[int, Request] = {}
        self.running: dict[int, Request] = {}
        self.next_req_id = 0
        # Block id -> every token up to the block's end, recorded once a request computed it.
        self.written: dict[int, tuple[int, ...]] = {}

    def _record_written(self, request: Request) -> None:
        block_ids = self.manager.get_block_ids(request.req_id)
        for i in range(request.num_computed_tokens // BLOCK_SIZE):
            self.written[block_ids[i]] = tuple(request.all_token_ids[: (i + 1) * BLOCK_SIZE])

    def _preempt(self, request: Request) -> None:
        self.manager.free(request)
        request.num_computed_tokens = 0
        del self.running[request.req_id]
        self.waiting[request.req_id] = request

    @precondition(lambda self: len(self.waiting) + len(self.running) < 8)
    @rule(
        prefix=st.sampled_from(PREFIXES),
        cut=st.integers(0, 12),
        suffix=st.lists(st.integers(0, 3), max_size=6),
    )
    def add_request(self, prefix: list[int], cut: int, suffix: list[int]) -> None:
        token_ids = prefix[:cut] + suffix or [0]
        self.waiting[self.next_req_id] = make_request(self.next_req_id, token_ids)
        self.next_req_id += 1

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 12), num_reserved=st.sampled_from([0, 0, 3, 9]))
    def admit(self, data: st.DataObject, chunk: int, num_reserved: int) -> None:
        request = self.waiting[data.draw(st.sampled_from(sorted(self.waiting)))]
        hit_ids, num_hit = self.manager.get_computed_blocks(request)
        assert num_hit == len(hit_ids) * BLOCK_SIZE < request.num_tokens
        for i, block_id in enumerate(hit_ids):
            assert self.written[block_id] == tuple(request.all_token_ids[: (i + 1) * BLOCK_SIZE])
        num_new = min(chunk, request.num_tokens - num_hit)
        new_ids = self.manager.allocate_slots(request, num_new, hit_ids, num_hit, num_reserved)
        if new_ids is None:
            return
        assert new_ids[: len(hit_ids)] == hit_ids
        request.num_computed_tokens = num_hit + num_new
        del self.waiting[request.req_id]
        self.running[request.req_id] = request
        self._record_written(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        # One engine step: every running request gets a chunk of prefill or one decode token.
        for request in [self.running[req_id] for req_id in sorted(self.running)]:
            if request.num_computed_tokens == request.num_tokens:
                request.append_output_token_id(data.draw(st.integers(0, 3)))
            num_left = request.num_tokens - request.num_computed_tokens
            num_new = data.draw(st.integers(1, num_left))
            if self.manager.allocate_slots(request, num_new) is None:
                self._preempt(request)
                continue
            request.num_computed_tokens += num_new
            self._record_written(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt_after_allocating(self, data: st.DataObject) -> None:
        # Allocated for a step, then preempted before the step counted: nothing was computed.
        request = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        self.manager.allocate_slots(request, request.num_tokens - request.num_computed_tokens)
        self._preempt(request)

    @precondition(lambda self: self.running or self.waiting)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        live = {**self.waiting, **self.running}
        request = live[data.draw(st.sampled_from(sorted(live)))]
        self.manager.free(request)
        self.waiting.pop(request.req_id, None)
        self.running.pop(request.req_id, None)

    def _chain_hash(self, token_ids: tuple[int, ...]) -> bytes:
        assert len(token_ids) % BLOCK_SIZE == 0
        block_hash = ROOT_BLOCK_HASH
        for start in range(0, len(token_ids), BLOCK_SIZE):
            block_hash = self.manager.hash_block(block_hash, token_ids[start : start + BLOCK_SIZE])
        return block_hash

    @invariant()
    def ref_counts_match_holders(self) -> None:
        holders = [0] * self.manager.block_pool.num_blocks
        for req_id, request in {**self.waiting, **self.running}.items():
            block_ids = self.manager.get_block_ids(req_id)
            assert len(set(block_ids)) == len(block_ids) and 0 not in block_ids
            assert len(block_ids) * BLOCK_SIZE >= request.num_computed_tokens
            for block_id in block_ids:
                holders[block_id] += 1
        assert [b.ref_cnt for b in self.manager.block_pool.blocks] == holders
        num_used = sum(1 for count in holders if count)
        assert self.manager.num_free_blocks + num_used == self.manager.num_usable_blocks
        queue = self.manager.block_pool.free_block_queue.get_all_free_blocks()
        assert len(queue) == self.manager.num_free_blocks

    @invariant()
    def cached_hashes_match_block_contents(self) -> None:
        positions: dict[int, list[tuple[Request, int]]] = {}
        for req_id, request in {**self.waiting, **self.running}.items():
            for i, block_id in enumerate(self.manager.get_block_ids(req_id)):
                positions.setdefault(block_id, []).append((request, i))
        for block_hash, block in self.manager.block_pool.cached_blocks.items():
            assert block.block_hash == block_hash
            if block.ref_cnt == 0:
                # A free cached block can be hit later: its KV must really have been computed.
                assert self._chain_hash(self.written[block.block_id]) == block_hash
            for request, i in positions.get(block.block_id, []):
                end = (i + 1) * BLOCK_SIZE
                assert self._chain_hash(tuple(request.all_token_ids[:end])) == block_hash

    def teardown(self) -> None:
        for request in {**self.waiting, **self.running}.values():
            self.manager.free(request)
        self.manager.check_all_free()


KVCacheMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None, print_blob=True
)
test_kv_cache_manager_invariants = KVCacheMachine.TestCase
