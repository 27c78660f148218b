"""The compiled CPU kernel on prompt chunks of any length against the torch path, same inputs.

The torch path (SDPA over gathered K/V with a mask, or explicit scores for sinks and soft-caps)
is the reference here: it is itself checked against dense float64 attention in test_attention.py.
Chunks run from 1 to 4096 tokens after cached prefixes that end on a block boundary and off it,
on shuffled blocks, for GQA ratios 1 to 8, head_dim 64 and 128, windows, sinks and soft-caps.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conveyor.worker.attention.cpu_kernel import PagedAttentionKernel, load_kernel
from conveyor.worker.attention.torch_backend import TorchAttentionBackend
from tests.worker.test_attention import Request, make_requests, step_inputs, store_prefix

BLOCK_SIZE = 16
pytestmark = pytest.mark.skipif(load_kernel() is None, reason="the CPU kernel cannot be built")


def make_batch(
    seed: int, shapes: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[list[Request], int]:
    """Requests of (cached prefix, chunk length) on one shuffled pool of blocks."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + q) // BLOCK_SIZE) for c, q in shapes) + 3
    pool = rng.permutation(num_blocks).tolist()
    requests = make_requests(
        gen, pool, shapes, BLOCK_SIZE, num_heads, num_kv_heads, torch.float32, head_dim
    )
    return requests, num_blocks


@pytest.fixture(autouse=True)
def kernel_calls(monkeypatch) -> list[int]:
    """One entry per call into the compiled kernel during the test."""
    calls: list[int] = []
    attend = PagedAttentionKernel.attend

    def counting_attend(self, query, *args, **kwargs) -> None:
        calls.append(query.shape[0])
        attend(self, query, *args, **kwargs)

    monkeypatch.setattr(PagedAttentionKernel, "attend", counting_attend)
    return calls


def attend_both_paths(
    requests: list[Request], num_blocks: int, **layer: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel output, torch-path output) of one step, each over its own copy of the cache."""
    num_kv_heads, head_dim = requests[0].keys.shape[1:]
    outputs = []
    for use_kernel in (True, False):
        kv_cache = torch.zeros(
            TorchAttentionBackend.kv_cache_shape(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
        )
        for r in requests:
            store_prefix(kv_cache, r, BLOCK_SIZE)
        metadata, _, query, key, value = step_inputs(requests, BLOCK_SIZE)
        backend = TorchAttentionBackend(use_cpu_kernel=use_kernel)
        outputs.append(
            backend.forward(query, key, value, kv_cache, metadata, head_dim**-0.5, **layer)
        )
    return outputs[0], outputs[1]


def assert_matches(kernel_out: torch.Tensor, torch_out: torch.Tensor) -> None:
    torch.testing.assert_close(kernel_out, torch_out, atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("chunk_len", [1, 7, 16, 17, 255, 256, 1000, 4096])
@pytest.mark.parametrize("prefix", [0, 32, 37], ids=["no-prefix", "aligned", "unaligned"])
def test_any_chunk_length_matches_the_torch_path(kernel_calls, chunk_len, prefix):
    # 8 heads on 2 KV heads (group 4): items of 8 tokens x 4 heads (16 on AVX-512 builds), so 7
    # and 17 leave a short item at the end of the chunk.
    requests, num_blocks = make_batch(chunk_len + prefix, [(prefix, chunk_len)], 8, 2, 64)
    kernel_out, torch_out = attend_both_paths(requests, num_blocks)
    # One call serves the whole step, decodes and prompt chunks alike.
    assert kernel_calls == [sum(r.num_scheduled for r in requests)]
    assert_matches(kernel_out, torch_out)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 4), (8, 2), (16, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gqa_ratios_and_head_dims_on_a_mixed_step(kernel_calls, num_heads, num_kv_heads, head_dim):
    # Decodes and prompt chunks of several lengths, some after cached prefixes, in one call.
    shapes = [(300, 1), (45, 300), (0, 130), (17, 1), (64, 64), (5, 3)]
    requests, num_blocks = make_batch(
        head_dim + num_heads, shapes, num_heads, num_kv_heads, head_dim
    )
    kernel_out, torch_out = attend_both_paths(requests, num_blocks)
    # One call serves the whole step, decodes and prompt chunks alike.
    assert kernel_calls == [sum(r.num_scheduled for r in requests)]
    assert_matches(kernel_out, torch_out)


@pytest.mark.parametrize("chunk_len", [17, 1000])
@pytest.mark.parametrize(
    "window,with_sinks,softcap",
    [
        (100, False, None),
        (None, True, None),
        (None, False, 30.0),
        (100, True, 30.0),
        (5, False, None),
    ],
    ids=["window", "sinks", "softcap", "all-three", "window-inside-a-tile"],
)
def test_windows_sinks_and_softcaps_match_the_torch_path(
    kernel_calls, chunk_len, window, with_sinks, softcap
):
    shapes = [(37, chunk_len), (250, 1), (0, 40)]
    requests, num_blocks = make_batch(chunk_len, shapes, 8, 2, 64)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(1)) if with_sinks else None
    kernel_out, torch_out = attend_both_paths(
        requests, num_blocks, sliding_window=window, sinks=sinks, softcap=softcap
    )
    # One call serves the whole step, decodes and prompt chunks alike.
    assert kernel_calls == [sum(r.num_scheduled for r in requests)]
    assert_matches(kernel_out, torch_out)


def test_a_window_reads_no_block_behind_it():
    # Blocks wholly behind every query's window are filled with NaN (as if reused by another
    # request): a read of any of them would poison the output.
    window, prefix, chunk_len = 40, 200, 300
    requests, num_blocks = make_batch(7, [(prefix, chunk_len)], 8, 2, 64)
    kv_cache = torch.zeros(TorchAttentionBackend.kv_cache_shape(num_blocks, BLOCK_SIZE, 2, 64))
    store_prefix(kv_cache, requests[0], BLOCK_SIZE)
    first_visible = prefix - window + 1
    for block_id in requests[0].block_ids[: first_visible // BLOCK_SIZE]:
        kv_cache[:, :, block_id] = float("nan")
    metadata, _, query, key, value = step_inputs(requests, BLOCK_SIZE)
    output = TorchAttentionBackend().forward(
        query, key, value, kv_cache, metadata, 0.125, sliding_window=window
    )
    _, torch_out = attend_both_paths(requests, num_blocks, sliding_window=window)
    assert not output.isnan().any()
    assert_matches(output, torch_out)


def test_two_tile_items_and_full_tiles_give_the_bits_of_half_size_tiles(monkeypatch):
    # Rows are vector lanes and every row's sums run in the same order whatever else its tile
    # holds, so the build's items (two 64-row tiles sharing each key tile with AVX-512, one
    # 32-row tile otherwise) change no output bit against one tile per item or tiles of half as
    # many rows: chunks that leave tiles of every row-vector count, pairs whose second tile
    # takes each width or another path, after prefixes on and off a block edge. Not so for a
    # chunk's last tile where it holds 8 rows or fewer in one plan only: below 8 rows the short
    # path computes each score as one dot product, and AVX-512 builds run 8-row tiles on 8-float
    # vectors, where GCC tuned for AMD's cores (avoid-fma-max-bits 256) splits a lone
    # accumulator's multiply-adds, so such a row can differ in the last bit. The chunk lengths
    # below leave no such tail (checked first).
    kernel = load_kernel(torch.float32, torch.float32)
    rows, tiles = kernel.max_rows, kernel.tiles_per_item
    assert (rows, tiles) in ((32, 1), (64, 2))
    plans = list(dict.fromkeys([(tiles, rows), (1, rows), (1, rows // 2)]))
    plan, num_items = [plans[0]], []
    attend = PagedAttentionKernel.attend

    def tokens(tiles_and_rows: tuple[int, int], group: int) -> int:
        return tiles_and_rows[0] * max(1, tiles_and_rows[1] // group)

    def planned_at(self, num_heads: int, num_kv_heads: int) -> int:
        return tokens(plan[0], num_heads // num_kv_heads)

    def counting_items(self, query, kv_cache, block_table, items, *args, **kwargs) -> None:
        num_items.append(len(items))
        attend(self, query, kv_cache, block_table, items, *args, **kwargs)

    monkeypatch.setattr(PagedAttentionKernel, "queries_per_item", planned_at)
    monkeypatch.setattr(PagedAttentionKernel, "attend", counting_items)
    common = [(0, 2048), (37, 47), (300, 31), (16, 1), (5, 303), (3, 15), (9, 79)]
    # GQA 2: a chunk of 35 is one tile of 32 tokens and 3 more (6 rows, the short path).
    for num_heads, num_kv_heads, extra in [(8, 4, [(9, 35)]), (4, 4, []), (16, 4, []), (24, 1, [])]:
        group = num_heads // num_kv_heads
        shapes = common + extra
        for _, chunk in shapes:
            tails = [((chunk - 1) % max(1, r // group) + 1) * group for r in (rows, rows // 2)]
            assert tails[0] == tails[1] or min(tails) > 8, (chunk, group, tails)
        # The plans that cut this group's chunks differently (a group of 24 fills a 16-row
        # tile no better than a 32-row one: one token each).
        distinct = {tokens(p, group): p for p in reversed(plans)}
        requests, num_blocks = make_batch(num_heads, shapes, num_heads, num_kv_heads, 64)
        outputs = []
        num_items.clear()
        for plan[0] in [distinct[q] for q in sorted(distinct, reverse=True)]:
            outputs.append(attend_both_paths(requests, num_blocks)[0])
        assert num_items == sorted(set(num_items)), num_items  # each plan cut it differently
        for output in outputs[1:]:
            assert torch.equal(outputs[0], output), (num_heads, num_kv_heads)
