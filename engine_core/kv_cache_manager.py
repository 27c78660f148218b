"""Which KV blocks each request holds, and which of them the prefix cache can hand to another.

Runs in the engine-core process. The manager owns blocks by ``req_id``; it reads requests
(``req_id``, ``all_token_ids``, ``num_computed_tokens``, ``num_tokens``) and never writes into them.
Block 0 is the pool's reserved null block, so ``num_blocks - 1`` blocks are usable.

Sliding-window models: when every layer attends only to the last W tokens, a request's blocks that
lie wholly behind the window of its next query are freed while it runs (the reason such models
are cheap to serve long), and their places in its table become the null block. One table serves
every layer, so a model mixing windowed and global layers frees nothing (the global layers need
every block). Freed blocks keep their prefix-cache entries until evicted:
a later request hits them as usual, and one whose chain has lost a block hits up to the gap.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable, Sequence

from conveyor.engine_core.block_pool import NULL_BLOCK_ID, BlockHash, BlockPool
from conveyor.engine_core.request import Request

# Parent of a request's first block.
ROOT_BLOCK_HASH: BlockHash = bytes(16)


BlockHasher = Callable[[BlockHash, Sequence[int]], BlockHash]


def make_block_hasher(block_size: int, key: bytes) -> BlockHasher:
    """Return ``hash_block(parent_hash, token_ids)``: a full block's tokens chained onto its parent.

    Why keyed BLAKE2b rather than builtin ``hash`` on a tuple: a collision makes one request read
    another's KV (wrong output, and a leak between users). Python's tuple hash is 64-bit and
    unkeyed for ints, so colliding prompts can be crafted; a 128-bit hash keyed with a
    per-process random key cannot be steered, and collides by chance with odds ~ n^2 / 2^129.
    Cost, measured for a 16-token block: ~1.2 us against ~0.3 us for ``hash(tuple)``, paid once
    per block as it fills (a 256-request decode step fills ~16 blocks). The keyed state is built
    once and copied, and the tokens packed by a precompiled struct, because those two dominated.
    """
    keyed = hashlib.blake2b(digest_size=16, key=key)
    pack = struct.Struct(f"<{block_size}q").pack

    def hash_block(parent_hash: BlockHash, token_ids: Sequence[int]) -> BlockHash:
        hasher = keyed.copy()
        hasher.update(parent_hash)
        hasher.update(pack(*token_ids))
        return hasher.digest()

    return hash_block


class _RequestBlocks:
    """What the manager keeps per request: its block table and its chained block hashes."""

    __slots__ = ("block_ids", "block_hashes", "num_cached_blocks", "num_hit_blocks", "num_dropped")

    def __init__(self) -> None:
        self.block_ids: list[int] = []
        # Hash of every full block of the request's known tokens, grown as blocks fill.
        self.block_hashes: list[BlockHash] = []
        # Leading blocks already registered in the prefix cache (or found there).
        self.num_cached_blocks = 0
        # Leading blocks that came from the prefix cache: computed by definition.
        self.num_hit_blocks = 0
        # Leading blocks freed behind the sliding window (their entries are the null block).
        self.num_dropped = 0


class KVCacheManager:
    """Allocates blocks to requests and shares full blocks between requests by prefix hash."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        # Cumulative: blocks freed behind a sliding window while their request ran.
        self.num_window_freed_blocks = 0
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self._blocks = self.block_pool.blocks
        self._requests: dict[int, _RequestBlocks] = {}
        self.hash_block = make_block_hasher(block_size, os.urandom(16))
        # Cumulative, in tokens.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.free_block_queue.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_block_ids(self, req_id: int) -> list[int]:
        """A copy of the request's block table ([] if it holds none)."""
        state = self._requests.get(req_id)
        return list(state.block_ids) if state is not None else []

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of the request's full blocks: (block_ids, num_computed_tokens).

        Never covers the last token, which must be recomputed to have logits to sample from, so
        at most ``(num_tokens - 1) // block_size`` blocks. Takes no references: pass the result
        to ``allocate_slots`` before any other allocation can evict them. Counts queries and hits
        in tokens (a request retried on later steps is counted again). ([], 0) when caching is off.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs come from the forward passes over the prompt: a hit skips them.
            return [], 0
        state = self._requests.get(request.req_id)
        if state is None:
            state = self._requests[request.req_id] = _RequestBlocks()
        num_tokens = request.num_tokens
        self._hash_full_blocks(request, state, num_tokens // self.block_size)
        cached = self.block_pool.cached_blocks
        hit_ids = []
        for block_hash in state.block_hashes[: (num_tokens - 1) // self.block_size]:
            block = cached.get(block_hash)
            if block is None:
                break
            hit_ids.append(block.block_id)
        num_hit_tokens = len(hit_ids) * self.block_size
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return hit_ids, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_block_ids: list[int] | None = None,
        num_new_computed_tokens: int = 0,
        num_reserved_tokens: int = 0,
    ) -> list[int] | None:
        """Give the request blocks for its computed, newly hit, new and reserved tokens.

        Returns the block ids added to its table by this call (hits first, then fresh blocks), or
        None, changing nothing, when the free blocks do not suffice. Then registers in the prefix
        cache every block that is now full of tokens the request knows. A decode step that needs
        no new block costs a few attribute reads: this runs once per running request per step.
        """
        state = self._requests.get(request.req_id)
        if self.sliding_window is not None and state is not None:
            self._drop_behind_window(state, request.num_computed_tokens)
        num_known = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        block_size = self.block_size
        if (
            state is None
            or new_computed_block_ids
            or num_known + num_reserved_tokens > len(state.block_ids) * block_size
        ):
            num_required = -(-(num_known + num_reserved_tokens) // block_size)
            new_block_ids = self._add_blocks(
                request.req_id, state, new_computed_block_ids or [], num_required
            )
            if new_block_ids is None:
                return None
            state = self._requests.get(request.req_id)
        else:
            new_block_ids = []
        if state is not None and self.enable_prefix_caching:
            num_tokens = len(request.all_token_ids)
            num_full = (num_known if num_known < num_tokens else num_tokens) // block_size
            if num_full > state.num_cached_blocks:
                self._cache_full_blocks(request, state, num_full)
        return new_block_ids

    def _drop_behind_window(self, state: _RequestBlocks, num_computed: int) -> None:
        """Free the blocks no query from position ``num_computed`` on can see.

        The earliest key such a query sees is num_computed - W + 1. With async scheduling
        num_computed already counts the step in flight, whose queries see further back; that
        is still safe, because a freed block is only written by a later step, after the
        in-flight one has read it.
        """
        first_needed = (num_computed - self.sliding_window + 1) // self.block_size  # type: ignore[operator]
        if first_needed <= state.num_dropped:
            return
        block_ids, blocks = state.block_ids, self._blocks
        end = min(first_needed, len(block_ids))
        dropped = [blocks[block_ids[i]] for i in range(state.num_dropped, end)]
        for i in range(state.num_dropped, end):
            block_ids[i] = NULL_BLOCK_ID
        state.num_dropped = end
        self.num_window_freed_blocks += len(dropped)
        # Last first, as free() does: the front of a prompt is the likeliest prefix to be shared,
        # so it is the last of these to be evicted.
        dropped.reverse()
        self.block_pool.free_blocks(dropped)

    def _add_blocks(
        self,
        req_id: int,
        state: _RequestBlocks | None,
        hit_ids: list[int],
        num_required: int,
    ) -> list[int] | None:
        num_held = len(state.block_ids) if state is not None else 0
        num_fresh = num_required - num_held - len(hit_ids)
        if num_fresh < 0:
            num_fresh = 0
        elif num_fresh == 0 and not hit_ids:
            return []
        if hit_ids:
            self._check_hits(state, hit_ids)
        blocks, pool = self._blocks, self.block_pool
        # A hit block nobody holds sits in the free queue: touching it takes it out of there, so
        # it cannot also be counted as free for the fresh blocks.
        num_free_hits = sum(blocks[i].ref_cnt == 0 for i in hit_ids) if hit_ids else 0
        if num_fresh > pool.free_block_queue.num_free_blocks - num_free_hits:
            return None
        if state is None:
            state = self._requests[req_id] = _RequestBlocks()
        if hit_ids:
            pool.touch([blocks[block_id] for block_id in hit_ids])
            state.block_ids.extend(hit_ids)
            state.num_cached_blocks = state.num_hit_blocks = len(hit_ids)
        fresh_ids = [block.block_id for block in pool.get_new_blocks(num_fresh)]
        state.block_ids.extend(fresh_ids)
        return hit_ids + fresh_ids if hit_ids else fresh_ids

    def _check_hits(self, state: _RequestBlocks | None, hit_ids: list[int]) -> None:
        # Hits only make sense as the first blocks of a request, straight from
        # get_computed_blocks; a hit evicted in between would hand the request someone's KV.
        if not self.enable_prefix_caching or state is None or state.block_ids:
            raise AssertionError(
                "computed blocks are only accepted from get_computed_blocks, "
                "for a request holding no blocks"
            )
        hashes = state.block_hashes
        for i, block_id in enumerate(hit_ids):
            if i >= len(hashes) or self._blocks[block_id].block_hash != hashes[i]:
                raise AssertionError(
                    f"computed block {block_id} no longer holds the request's block {i}: "
                    "call get_computed_blocks right before allocate_slots"
                )

    def _hash_full_blocks(self, request: Request, state: _RequestBlocks, num_full: int) -> None:
        # Incremental: only blocks that filled since the last call are hashed.
        hashes, size, hash_block = state.block_hashes, self.block_size, self.hash_block
        token_ids = request.all_token_ids
        if hashes:
            parent = hashes[-1]
        elif request.cache_salt or request.lora is not None:
            # A salted chain starts from its own root: no block of it equals an unsalted one.
            # (Unkeyed is enough: the blocks are hashed with the key from this root on, and two
            # salts share a root only by a BLAKE2b collision.) A LoRA adapter salts the chain
            # too: the same prompt under two adapters has different keys and values.
            salt = b"cache-salt:" + (request.cache_salt or "").encode()
            if request.lora is not None:
                salt += b"\0lora:" + request.lora.key.encode()
            parent = hashlib.blake2b(salt, digest_size=16).digest()
        else:
            parent = ROOT_BLOCK_HASH
        for i in range(len(hashes), num_full):
            parent = hash_block(parent, token_ids[i * size : (i + 1) * size])
            hashes.append(parent)

    def _cache_full_blocks(self, request: Request, state: _RequestBlocks, num_full: int) -> None:
        self._hash_full_blocks(request, state, num_full)
        blocks, pool, hashes = self._blocks, self.block_pool, state.block_hashes
        for i in range(state.num_cached_blocks, num_full):
            if i < state.num_dropped:  # freed behind the window: registered before, if ever
                continue
            block = blocks[state.block_ids[i]]
            if block.block_hash is None:
                pool.cache_full_block(block, hashes[i])
        state.num_cached_blocks = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first; a second call does nothing.

        Trusts ``request.num_computed_tokens`` to say what is (or, for steps already sent, will
        be) in the KV cache: call before resetting it on preemption. Full computed blocks stay
        cached for later hits; a block registered for tokens that were never computed (the
        request was allocated and then preempted in the same step) is dropped from the cache.
        """
        state = self._requests.pop(request.req_id, None)
        if state is None:
            return
        if self.enable_prefix_caching and state.block_ids:
            num_computed = min(request.num_computed_tokens, request.num_tokens)
            num_full = min(num_computed // self.block_size, len(state.block_ids))
            if num_full > state.num_cached_blocks:
                self._cache_full_blocks(request, state, num_full)
            self._uncache_uncomputed(state, num_full)
        blocks = self._blocks
        held = state.block_ids[state.num_dropped :] if state.num_dropped else state.block_ids
        self.block_pool.free_blocks([blocks[block_id] for block_id in reversed(held)])

    def _uncache_uncomputed(self, state: _RequestBlocks, num_computed_blocks: int) -> None:
        for i in range(max(num_computed_blocks, state.num_hit_blocks), state.num_cached_blocks):
            block = self._blocks[state.block_ids[i]]
            # A block someone else holds too was hit by a request admitted after this one was
            # allocated in the same step. Schedulers preempt before they admit, so this should
            # not happen; dropping the entry would not repair that request's view anyway.
            if block.ref_cnt == 1:
                self.block_pool.uncache_block(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False (nothing changed) while any block is held."""
        return self.block_pool.reset_prefix_cache()

    def check_all_free(self) -> None:
        """Raise AssertionError unless no request holds blocks and the pool is all free."""
        holders = [req_id for req_id, state in self._requests.items() if state.block_ids]
        if holders:
            raise AssertionError(f"requests still hold blocks: req_ids {holders[:20]}")
        self.block_pool.check_all_free()
