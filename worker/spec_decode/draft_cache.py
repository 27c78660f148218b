"""What a draft model's KV cache holds, block by block: which prefix's real tokens, if any.

Runs in worker processes. The draft shares the target's block ids (worker/spec_decode/
draft_model.py), but the draft's own tensors are written only by the draft, at its own times: a
block the engine's prefix cache hands a new request may hold the draft KV of exactly that
prefix, of other tokens (the block was freed and reused, the draft ran on another request), of
a draft's guesses, or nothing the draft ever wrote (speculation was off while the target filled
it). So every block the draft fills with a request's real tokens is keyed by the whole prefix it
holds (a chain of hashes over the blocks' tokens, as the engine keys its prefix cache), any
other draft write to a block clears its key first, and a new row trusts its leading blocks only
while their keys are its own prefix's.

A wrong key (a hash collision) would cost acceptance, never correctness: drafts are guesses, and
the target verifies every one.
"""

from __future__ import annotations

from conveyor.worker.input_batch import InputBatch


class DraftBlockKeys:
    """Per block id, the key of the prefix whose real tokens' draft KV the block holds."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self._keys: list[int | None] = [None] * num_blocks

    def trusted_prefix(self, batch: InputBatch, row: int) -> int:
        """Positions at the start of a new row whose draft KV is already its own: the leading
        blocks whose key is the row's prefix's (never the block of its latest token, whose
        logits the draft must compute)."""
        num_full = (int(batch.num_tokens[row]) - 1) // self.block_size
        count = 0
        for i, key in enumerate(self._prefix_keys(batch, row, num_full)):
            block_id = int(batch.block_table[row, i])
            if not block_id or self._keys[block_id] != key:
                break
            count += 1
        return count * self.block_size

    def forget(self, batch: InputBatch, row: int, first: int, last: int) -> None:
        """The blocks holding the row's positions ``first .. last`` are about to be written."""
        size = self.block_size
        for i in range(first // size, last // size + 1):
            self._keys[int(batch.block_table[row, i])] = None

    def record(self, batch: InputBatch, row: int) -> None:
        """After a proposal: the row's blocks full of real tokens hold its prefixes' draft KV."""
        num_full = int(batch.num_tokens[row]) // self.block_size
        for i, key in enumerate(self._prefix_keys(batch, row, num_full)):
            block_id = int(batch.block_table[row, i])
            if block_id:  # 0: the null block, a slot nobody reads
                self._keys[block_id] = key

    def _prefix_keys(self, batch: InputBatch, row: int, num_blocks: int) -> list[int]:
        """The row's block keys up to ``num_blocks`` full blocks, extending those it keeps."""
        keys = batch.row_states[row].draft_block_keys
        size = self.block_size
        for i in range(len(keys), num_blocks):
            block = batch.token_ids[row, i * size : (i + 1) * size].tobytes()
            keys.append(hash((keys[-1] if keys else 0, block)))
        return keys[:num_blocks]
