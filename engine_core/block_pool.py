"""The pool of paged-KV blocks: ref counts, an LRU free queue and the prefix-cache index.

Runs in the engine-core process. These blocks are bookkeeping only (an id, a ref count, a hash);
the workers own the tensors that the ids index.

Block 0 is reserved as the null block: it is never handed out, so the workers can pad block tables
with 0 and point padding slots at it without touching any request's KV. A pool of ``num_blocks``
therefore has ``num_blocks - 1`` usable blocks.
"""

from __future__ import annotations

from collections.abc import Iterable

# A chained block hash (see kv_cache_manager.hash_block_tokens).
BlockHash = bytes

NULL_BLOCK_ID = 0


class KVCacheBlock:
    """One block of KV slots. ``block_hash`` is set while the block is in the prefix cache."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        # Links of the free queue; both None while the block is not in it.
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "uncached"
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, {cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks in eviction order: the head is evicted first.

    Freed blocks join the tail, so the least recently freed cached block is the first reused. A
    cached free block that gets a prefix hit leaves from the middle, in O(1) through its own
    links; a Python list or deque would make that O(pool).
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        # Sentinels at both ends keep append/remove free of None checks.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        block.prev_free = last
        block.next_free = self._tail
        last.next_free = block
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        prev_block, next_block = block.prev_free, block.next_free
        if prev_block is None or next_block is None:
            raise ValueError(f"{block} is not in the free queue")
        prev_block.next_free = next_block
        next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, head first. O(pool): for checks and tests, not the hot path."""
        found = []
        block = self._head.next_free
        while block is not None and block is not self._tail:
            found.append(block)
            block = block.next_free
        return found


class BlockPool:
    """Hands out blocks, counts their holders and indexes full blocks by hash.

    A block is in exactly one of three states: held (ref_cnt > 0, not in the free queue), free
    and cached (ref_cnt 0, in the queue, hash set: reusable by a prefix hit until evicted), or
    free and empty (ref_cnt 0, in the queue, no hash).
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_block_queue = FreeBlockQueue(self.blocks[NULL_BLOCK_ID + 1 :])
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_usable_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` from the head of the free queue, evicting their cached hashes."""
        queue = self.free_block_queue
        if num_blocks > queue.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, only {queue.num_free_blocks} free")
        taken = []
        for _ in range(num_blocks):
            block = queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def _evict(self, block: KVCacheBlock) -> None:
        # Another block may have been indexed under the same hash; only drop our own entry.
        if self.cached_blocks.get(block.block_hash) is block:  # type: ignore[arg-type]
            del self.cached_blocks[block.block_hash]  # type: ignore[arg-type]
        block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a holder to each block; a free (cached) block leaves the free queue."""
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a holder from each block; a block nobody holds joins the free queue's tail.

        Callers pass a request's blocks last first, so the tail of a sequence (the part least
        likely to be shared) is evicted before its prefix.
        """
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt <= 0:
                raise AssertionError(f"freeing {block}, which nobody holds")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                queue.append(block)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Index a full block by its hash; False (nothing changed) if the hash is taken.

        Two requests that computed the same prefix at once each hold a copy; the first one
        indexed stays the cache entry and the other copy is freed as a plain block.
        """
        if not self.enable_caching or block_hash in self.cached_blocks:
            return False
        if block.block_hash is not None:
            raise AssertionError(f"{block} is already cached under another hash")
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block
        return True

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Drop a block from the prefix cache (its KV will never be written as hashed)."""
        if block.block_hash is not None:
            self._evict(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is held."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        return True

    def check_all_free(self) -> None:
        """Raise AssertionError naming what is wrong unless every usable block is free."""
        held = [b.block_id for b in self.blocks[NULL_BLOCK_ID + 1 :] if b.ref_cnt != 0]
        if held:
            raise AssertionError(f"{len(held)} blocks still have holders: ids {held[:20]}")
        queued = self.free_block_queue.get_all_free_blocks()
        queued_ids = {b.block_id for b in queued}
        if len(queued) != self.num_usable_blocks or len(queued_ids) != len(queued):
            missing = sorted(set(range(1, self.num_blocks)) - queued_ids)
            raise AssertionError(
                f"free queue holds {len(queued)} blocks ({len(queued_ids)} distinct), expected "
                f"{self.num_usable_blocks}; missing ids {missing[:20]}"
            )
        if self.free_block_queue.num_free_blocks != len(queued):
            raise AssertionError(
                f"free count {self.free_block_queue.num_free_blocks} != queue length {len(queued)}"
            )
        if NULL_BLOCK_ID in queued_ids or self.null_block.ref_cnt != 0:
            raise AssertionError("the null block 0 was handed out")
