"""The Triton paged-attention kernel against dense causal attention written out in float64.

On the CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set by
tests/devices.py before anything imports triton: the same kernel source, each program executed
with numpy), which checks its indexing, masking and online softmax;
with CONVEYOR_TEST_DEVICE=cuda it is compiled and run on the GPU, float32 and bfloat16.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conveyor.worker.attention.selector import select_backend
from conveyor.worker.attention.torch_backend import TorchAttentionBackend
from conveyor.worker.attention.triton_backend import (
    TritonAttentionBackend,
    triton_import_error,
    triton_unusable_reason,
)
from tests.devices import TEST_DEVICE
from tests.worker.test_attention import (
    HEAD_DIM,
    make_requests,
    random_mixed_batch,
    reference_attention,
    slot_view,
    step_inputs,
    store_prefix,
)

pytestmark = [
    pytest.mark.gpu_kernel,
    pytest.mark.skipif(
        triton_import_error() is not None, reason=f"needs triton ({triton_import_error()})"
    ),
]
DEVICE = torch.device("cuda" if TEST_DEVICE == "cuda" else "cpu")


def run(
    requests,
    num_blocks,
    block_size,
    num_kv_heads,
    dtype=torch.float32,
    scale=None,
    config=None,
    **kw,
):
    head_dim = requests[0].query.shape[-1]
    scale = head_dim**-0.5 if scale is None else scale
    kv_cache = torch.zeros(
        TorchAttentionBackend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    )
    for r in requests:  # filled in float32 on the host, then moved and cast
        store_prefix(kv_cache, r, block_size)
    metadata, _, query, key, value = step_inputs(requests, block_size, DEVICE)
    kv_cache = kv_cache.to(DEVICE, dtype)
    sinks = kw.get("sinks")
    backend = TritonAttentionBackend(config)
    backend.multiprocessors = kw.get("multiprocessors")  # set: split-K decode on the CPU too
    output = backend.forward(
        query.to(dtype),
        key.to(dtype),
        value.to(dtype),
        kv_cache,
        metadata,
        scale,
        kw.get("sliding_window"),
        None if sinks is None else sinks.to(DEVICE),
        kw.get("softcap"),
    )
    expected = torch.cat(
        [
            reference_attention(r, scale, kw.get("sliding_window"), sinks, kw.get("softcap"))
            for r in requests
        ]
    )
    return output, expected.float(), kv_cache, metadata, key, value


def assert_close(output, expected, dtype=torch.float32):
    # float32 runs with IEEE dots (no TF32): the torch backend's tolerance.
    tol = 1e-5 if dtype == torch.float32 and DEVICE.type == "cpu" else 1e-4
    if dtype != torch.float32:
        tol = 2e-2
    torch.testing.assert_close(output.float().cpu(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (16, 1), (12, 4), (14, 2)])
def test_mixed_batches_match_dense_attention(block_size, num_heads, num_kv_heads):
    # GQA groups 1, 4, 16, 3 and 7: the last two do not divide the tile's rows.
    requests, num_blocks = random_mixed_batch(block_size, block_size, num_heads, num_kv_heads)
    output, expected, kv_cache, metadata, key, value = run(
        requests, num_blocks, block_size, num_kv_heads
    )
    assert_close(output, expected)
    slots = metadata.slot_mapping
    for cache, written in zip(slot_view(kv_cache), (key, value)):
        torch.testing.assert_close(cache[:, slots].cpu(), written.transpose(0, 1).cpu())


@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_head_dims_that_fill_pad_and_span_tiles(head_dim):
    # 80 is padded to 128 lanes; the prompt chunks span several query and key tiles.
    gen = torch.Generator().manual_seed(head_dim)
    shapes = [(0, 150), (37, 90), (200, 1), (64, 64), (5, 1)]
    pool = np.random.default_rng(head_dim).permutation(60).tolist()
    requests = make_requests(gen, pool, shapes, 16, 8, 2, torch.float32, head_dim)
    output, expected, *_ = run(requests, 60, 16, 2)
    assert_close(output, expected)


def test_a_decode_only_step_matches_dense_attention():
    gen = torch.Generator().manual_seed(3)
    shapes = [(n, 1) for n in (0, 1, 15, 16, 17, 63, 64, 65, 200)]
    pool = np.random.default_rng(3).permutation(40).tolist()
    requests = make_requests(gen, pool, shapes, 16, 8, 2, torch.float32)
    output, expected, *_ = run(requests, 40, 16, 2)
    assert_close(output, expected)


@pytest.mark.parametrize("sliding_window", [1, 5, 24, 37, 100])
def test_sliding_windows_match_dense_attention(sliding_window):
    requests, num_blocks = random_mixed_batch(7, 16, 8, 2, num_reqs=9)
    output, expected, *_ = run(requests, num_blocks, 16, 2, sliding_window=sliding_window)
    assert_close(output, expected)


@pytest.mark.parametrize("sliding_window", [None, 13])
@pytest.mark.parametrize("softcap", [None, 2.5])
def test_sinks_and_softcap_match_dense_attention(sliding_window, softcap):
    requests, num_blocks = random_mixed_batch(9, 16, 8, 2, num_reqs=8)
    for r in requests:
        r.query.mul_(4.0)  # scores past the cap, so the tanh bends them
    sinks = torch.linspace(-4.0, 6.0, 8)
    output, expected, *_ = run(
        requests,
        num_blocks,
        16,
        2,
        scale=0.25,
        sliding_window=sliding_window,
        sinks=sinks,
        softcap=softcap,
    )
    assert_close(output, expected)


def test_padded_rows_after_the_actual_tokens_come_out_zero():
    requests, num_blocks = random_mixed_batch(4, 16, 4, 2, num_reqs=3)
    kv_cache = torch.zeros(TorchAttentionBackend.kv_cache_shape(num_blocks, 16, 2, HEAD_DIM))
    metadata, _, query, key, value = step_inputs(requests, 16, DEVICE)
    padded, key, value = (
        torch.cat([x.cpu(), torch.randn(5, *x.shape[1:])]).to(DEVICE) for x in (query, key, value)
    )
    out = TritonAttentionBackend().forward(padded, key, value, kv_cache.to(DEVICE), metadata, 0.25)
    assert out.shape == padded.shape
    assert torch.count_nonzero(out[metadata.num_actual_tokens :]) == 0


@pytest.mark.skipif(DEVICE.type != "cuda", reason="bfloat16 dots need the GPU")
def test_bfloat16_matches_dense_attention_on_cuda():
    gen = torch.Generator().manual_seed(11)
    shapes = [(0, 300), (120, 1), (500, 1), (33, 77), (0, 1)]
    pool = np.random.default_rng(11).permutation(80).tolist()
    requests = make_requests(gen, pool, shapes, 16, 16, 8, torch.float32, 128)
    output, expected, *_ = run(requests, 80, 16, 8, dtype=torch.bfloat16)
    assert_close(output, expected, torch.bfloat16)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="bfloat16 dots need the GPU")
def test_bfloat16_long_chunks_through_sdpa_and_the_kernel_match_dense_attention_on_cuda():
    # A fresh 1,100-token chunk (SDPA), one after 40 cached tokens (the 128x128 tiles), decodes.
    gen = torch.Generator().manual_seed(12)
    shapes = [(0, 1100), (40, 1100), (200, 1), (0, 1)]
    pool = np.random.default_rng(12).permutation(160).tolist()
    requests = make_requests(gen, pool, shapes, 16, 16, 8, torch.float32, 128)
    output, expected, *_ = run(requests, 160, 16, 8, dtype=torch.bfloat16)
    assert_close(output, expected, torch.bfloat16)


def test_triton_is_named_where_it_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "CUDA device" in triton_unusable_reason(torch.device("cpu"))
    with pytest.raises(ValueError, match="'triton' cannot run here: it needs a CUDA device"):
        select_backend(torch.device("cpu"), 16, "triton")


def test_an_engine_on_the_triton_backend_gives_the_torch_backends_tokens(tiny_model_dir):
    # Chunked prompts (a 32-token budget), shared prefixes and decodes through the whole engine.
    from conveyor.frontend import LLM
    from conveyor.protocol import SamplingParams

    rng = np.random.default_rng(0)
    shared = rng.integers(3, 200, 20).tolist()
    prompts = [shared + rng.integers(3, 200, int(rng.integers(1, 40))).tolist() for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    # On a GPU these few requests' decode steps split their keys (split-K); on the CPU the
    # split's kernels are checked alone (forced through the engine it took 13 s more here).
    for backend in ("triton", "torch"):
        with LLM(
            str(tiny_model_dir),
            engine="inprocess",
            device=DEVICE.type,
            dtype="float32",
            attention_backend=backend,
            max_num_batched_tokens=32,
            enable_prefix_caching=True,
            # A share of the GPU beside the test's own tensors; a CPU engine takes none.
            **({"gpu_memory_utilization": 0.3} if DEVICE.type == "cuda" else {}),
        ) as llm:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            tokens[backend] = [o.outputs[0].token_ids for o in outputs]
            assert llm.stats.prefix_cache_hits > 0
    assert tokens["triton"] == tokens["torch"]


def test_the_output_lands_in_a_buffer_the_caller_gives():
    # What a CUDA graph piece reads: attention writes its fixed buffer, no copy after.
    requests, num_blocks = random_mixed_batch(5, 16, 8, 2, num_reqs=6)
    kv_cache = torch.zeros(TorchAttentionBackend.kv_cache_shape(num_blocks, 16, 2, HEAD_DIM))
    for r in requests:
        store_prefix(kv_cache, r, 16)
    metadata, _, query, key, value = step_inputs(requests, 16, DEVICE)
    kv_cache = kv_cache.to(DEVICE)
    buffer = torch.full_like(query, float("nan"))
    out = TritonAttentionBackend().forward(
        query, key, value, kv_cache, metadata, HEAD_DIM**-0.5, out=buffer
    )
    assert out.data_ptr() == buffer.data_ptr()
    expected = torch.cat([reference_attention(r, HEAD_DIM**-0.5) for r in requests]).float()
    assert_close(buffer, expected)


def test_a_decode_step_padded_for_a_whole_graph_matches_and_writes_only_its_slots():
    # A whole-forward CUDA graph of 8 replays a step of 4 decodes with 4 padding requests
    # (worker/step_inputs.py pads the fixed buffers): the real rows must come out as without the
    # padding, and the cache must change at the real slots alone.
    from conveyor.worker.attention.backend import AttentionMetadata
    from conveyor.worker.attention.metadata_builder import StepLayout
    from conveyor.worker.step_inputs import _padded_decode

    gen = torch.Generator().manual_seed(5)
    shapes = [(n, 1) for n in (0, 15, 16, 40)]
    pool = np.random.default_rng(5).permutation(20).tolist()
    requests = make_requests(gen, pool, shapes, 16, 8, 2, torch.float32)
    kv_cache = torch.zeros(TorchAttentionBackend.kv_cache_shape(20, 16, 2, HEAD_DIM))
    for r in requests:
        store_prefix(kv_cache, r, 16)
    metadata, positions, query, key, value = step_inputs(requests, 16, DEVICE)
    layout = StepLayout(
        query_start_loc=metadata.query_start_loc_cpu,
        positions=positions,
        slot_mapping=metadata.slot_mapping.cpu().numpy(),
        seq_lens=metadata.seq_lens_cpu,
        max_query_len=1,
        max_seq_len=metadata.max_seq_len,
    )
    slots, starts, seq_lens = _padded_decode(layout, 8)
    table = metadata.block_table.cpu()
    # Stale rows from earlier steps: blocks the padding must not read.
    stale = torch.from_numpy(np.random.default_rng(1).integers(0, 20, (4, table.shape[1])))
    padded = AttentionMetadata(
        num_actual_tokens=8,
        slot_mapping=torch.from_numpy(slots).to(DEVICE),
        query_start_loc=torch.from_numpy(starts).to(DEVICE),
        seq_lens=torch.from_numpy(seq_lens).to(DEVICE),
        block_table=torch.cat([table, stale.to(table.dtype)]).to(DEVICE),
        max_query_len=1,
        max_seq_len=metadata.max_seq_len,
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
    noise = [torch.randn(4, *x.shape[1:]) * 100 for x in (query, key, value)]
    q8, k8, v8 = (torch.cat([x.cpu(), n]).to(DEVICE) for x, n in zip((query, key, value), noise))
    backend = TritonAttentionBackend()
    cache_padded, cache_plain = kv_cache.to(DEVICE), kv_cache.to(DEVICE)
    out8 = backend.forward(q8, k8, v8, cache_padded, padded, HEAD_DIM**-0.5)
    out4 = backend.forward(query, key, value, cache_plain, metadata, HEAD_DIM**-0.5)
    assert out8.shape[0] == 8
    torch.testing.assert_close(out8[:4], out4, atol=0, rtol=0)
    assert torch.count_nonzero(out8[4:]) == 0  # the padding rows: zeros, as eager steps give
    assert torch.equal(cache_padded, cache_plain)
    expected = torch.cat([reference_attention(r, HEAD_DIM**-0.5) for r in requests]).float()
    assert_close(out4, expected)


def test_decode_steps_split_each_requests_keys_only_while_the_device_is_underfilled():
    from conveyor.worker.attention.triton_backend import decode_segments

    # An H200 (132 multiprocessors), Qwen3-0.6B's 8 KV heads: about two programs each.
    assert [decode_segments(n, 8, 132) for n in (1, 2, 4, 8, 16, 17, 64)] == [16, 16, 8, 4, 2, 1, 1]
    assert decode_segments(0, 8, 132) == decode_segments(3, 8, 0) == 1  # nothing, or a CPU


@pytest.mark.parametrize(
    ("multiprocessors", "extras"),
    [
        (16, {}),  # 2 runs a request
        (64, {}),  # 8 runs
        (64, {"sliding_window": 37}),
        (64, {"sinks": torch.linspace(-4.0, 6.0, 8), "softcap": 2.5}),
    ],
    ids=["2 runs", "8 runs", "8 runs, window", "8 runs, sinks and soft-cap"],
)
def test_split_k_decode_steps_match_dense_attention(multiprocessors, extras):
    from conveyor.worker.attention.triton_backend import decode_segments

    # Contexts of 0 to 300 keys over blocks of 16: runs of whole 64-key tiles, some empty.
    gen = torch.Generator().manual_seed(multiprocessors)
    shapes = [(n, 1) for n in (0, 1, 63, 64, 65, 200, 300)]
    pool = np.random.default_rng(4).permutation(60).tolist()
    requests = make_requests(gen, pool, shapes, 16, 8, 2, torch.float32)
    assert decode_segments(len(shapes), 2, multiprocessors) == multiprocessors // 8
    output, expected, *_ = run(requests, 60, 16, 2, multiprocessors=multiprocessors, **extras)
    assert_close(output, expected)


def test_a_split_k_decode_padded_for_a_whole_graph_gives_zeros_in_its_padding_rows():
    # Padding requests (no context, slot -1) through the split and the merge: zeros, as unsplit;
    # the workspace a graph would capture is the same tensor whatever the step's size.
    from conveyor.worker.attention.backend import AttentionMetadata

    gen = torch.Generator().manual_seed(9)
    requests = make_requests(gen, list(range(1, 30)), [(40, 1), (130, 1)], 16, 8, 2, torch.float32)
    kv_cache = torch.zeros(TorchAttentionBackend.kv_cache_shape(30, 16, 2, HEAD_DIM))
    for r in requests:
        store_prefix(kv_cache, r, 16)
    metadata, _, query, key, value = step_inputs(requests, 16, DEVICE)
    seq_lens = np.array([41, 131, 0, 0], dtype=np.int32)
    starts = np.arange(5, dtype=np.int32)
    table = torch.cat([metadata.block_table.cpu(), torch.zeros(2, metadata.block_table.shape[1])])
    padded = AttentionMetadata(
        num_actual_tokens=4,
        slot_mapping=torch.cat([metadata.slot_mapping.cpu(), torch.tensor([-1, -1])]).to(DEVICE),
        query_start_loc=torch.from_numpy(starts).to(DEVICE),
        seq_lens=torch.from_numpy(seq_lens).to(DEVICE),
        block_table=table.to(torch.int32).to(DEVICE),
        max_query_len=1,
        max_seq_len=131,
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
    q4, k4, v4 = (
        torch.cat([x.cpu(), torch.randn(2, *x.shape[1:]) * 100]).to(DEVICE)
        for x in (query, key, value)
    )
    backend = TritonAttentionBackend()
    backend.multiprocessors = 16  # 4 requests x 2 KV heads: 4 runs each
    sinks = torch.linspace(-1.0, 1.0, 8).to(DEVICE)
    out = backend.forward(q4, k4, v4, kv_cache.to(DEVICE), padded, HEAD_DIM**-0.5, sinks=sinks)
    assert torch.count_nonzero(out[2:]) == 0
    expected = torch.cat(
        [reference_attention(r, HEAD_DIM**-0.5, sinks=sinks.cpu()) for r in requests]
    )
    assert_close(out[:2], expected.float())
    workspace = backend._workspace(8, 2, HEAD_DIM, DEVICE)
    assert all(a is b for a, b in zip(workspace, backend._workspace(8, 2, HEAD_DIM, DEVICE)))


def test_an_eager_decode_larger_than_any_graph_leaves_the_graphs_tiles_in_place():
    # The whole-forward graphs hold the decode tiles' address: a bigger eager step (more
    # requests than the largest captured size) must not replace them.
    from conveyor.worker.cuda_graphs import MAX_CAPTURE_SIZE

    backend = TritonAttentionBackend()
    tiles, firsts = backend._decode_tiles_for(8, DEVICE)
    address = tiles.data_ptr()
    bigger, bigger_firsts = backend._decode_tiles_for(MAX_CAPTURE_SIZE + 100, DEVICE)
    assert bigger.tolist() == list(range(MAX_CAPTURE_SIZE + 100))
    assert not bigger_firsts.any()
    assert backend._decode_tiles_for(8, DEVICE)[0].data_ptr() == address
    assert tiles.tolist() == list(range(8)) and not firsts.any()


@pytest.mark.parametrize(
    "text",
    ["16x16", "32x128/w2", "128x32/w8/s1", "16x64/s3", "128x128/w8/s3"],
    ids=lambda text: text,
)
def test_every_tile_shape_bench_attention_can_try_computes_the_same_attention(text):
    # python -m benchmarks attention --triton-configs times other shapes: each must stay correct, on
    # prompt chunks (queries spanning several tiles) and decodes alike, with GQA.
    from conveyor.worker.attention.triton_backend import KernelConfig

    config = KernelConfig.parse(text)
    requests, num_blocks = random_mixed_batch(11, 16, 8, 2, num_reqs=6)
    output, expected, *_ = run(requests, num_blocks, 16, 2, config=config)
    assert_close(output, expected)


@pytest.mark.parametrize("case", ["mixed", "all fresh", "windowed"])
def test_long_fresh_prompt_chunks_go_to_sdpa_and_the_rest_to_the_kernel(monkeypatch, case):
    # On CUDA a chunk with nothing cached before it, of 1,024+ tokens, runs through SDPA's
    # causal kernel; here the threshold is 40 and SDPA is let serve float32 on the CPU.
    from conveyor.worker.attention import triton_backend

    monkeypatch.setattr(triton_backend, "_SDPA_MIN_CHUNK", 40)
    monkeypatch.setattr(TritonAttentionBackend, "_sdpa_serves", lambda self, query: True)
    routed = []
    attend = triton_backend._attend_with_sdpa

    def spy(*args):
        routed.append(np.flatnonzero(args[5]).tolist())
        attend(*args)

    monkeypatch.setattr(triton_backend, "_attend_with_sdpa", spy)
    tiled = []

    class Plan(triton_backend._TilePlan):
        def __init__(self, query_lens, *args) -> None:
            tiled.append(query_lens.tolist())
            super().__init__(query_lens, *args)

    monkeypatch.setattr(triton_backend, "_TilePlan", Plan)
    shapes = [(0, 50), (0, 90)]
    if case != "all fresh":  # a cached prefix, a short fresh chunk, decodes
        shapes = [(0, 50), (30, 60), (0, 39), (17, 1), (0, 90), (5, 1)]
    gen = torch.Generator().manual_seed(len(shapes))
    pool = np.random.default_rng(7).permutation(60).tolist()
    requests = make_requests(gen, pool, shapes, 16, 8, 2, torch.float32)
    window = 24 if case == "windowed" else None
    output, expected, kv_cache, metadata, key, value = run(
        requests, 60, 16, 2, sliding_window=window
    )
    assert_close(output, expected)
    # A window (or sinks, a soft-cap) keeps every chunk in the kernel.
    assert routed == {"mixed": [[0, 4]], "all fresh": [[0, 1]], "windowed": []}[case]
    # The kernel tiles only the rest (a step with nothing left never launches it).
    expected_tiles = {
        "mixed": [[0, 60, 39, 1, 0, 1]],
        "all fresh": [],
        "windowed": [[50, 60, 39, 1, 90, 1]],
    }
    assert tiled == expected_tiles[case]
    slots = metadata.slot_mapping  # every request's keys are in the cache, routed ones too
    for cache, written in zip(slot_view(kv_cache), (key, value)):
        torch.testing.assert_close(cache[:, slots].cpu(), written.transpose(0, 1).cpu())


def test_long_prompt_chunks_in_two_byte_dtypes_take_the_long_chunk_tiles():
    from conveyor.worker.attention.triton_backend import (
        _DEFAULT_CONFIG,
        _LONG_CHUNK,
        _LONG_CHUNK_CONFIG,
        KernelConfig,
    )

    backend = TritonAttentionBackend()
    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    assert backend.kernel_config(_LONG_CHUNK, 128, bf16) == _LONG_CHUNK_CONFIG
    assert backend.kernel_config(4 * _LONG_CHUNK, 64, f16) == _LONG_CHUNK_CONFIG
    # Shorter chunks and decodes, float32 and wider heads keep the defaults.
    for query_len, head_dim, dtype in [
        (_LONG_CHUNK - 1, 128, bf16),
        (1, 128, bf16),
        (8192, 128, f32),
        (8192, 256, bf16),
    ]:
        assert backend.kernel_config(query_len, head_dim, dtype) == _DEFAULT_CONFIG
    # A configured shape (bench attention --triton-configs) is used for every step.
    chosen = KernelConfig(32, 32)
    assert TritonAttentionBackend(chosen).kernel_config(8192, 128, bf16) == chosen


def test_a_kernel_config_is_read_from_its_text_and_refused_when_malformed():
    from conveyor.worker.attention.triton_backend import KernelConfig

    assert KernelConfig.parse("128x32/w8/s3") == KernelConfig(128, 32, 8, 3)
    assert KernelConfig.parse("64x64").launch_options() == {}
    assert KernelConfig(16, 16, num_warps=2).launch_options() == {"num_warps": 2}
    for text in ("64", "64x64/q2", "axb"):
        with pytest.raises(ValueError, match="expected ROWSxKEYS"):
            KernelConfig.parse(text)
    with pytest.raises(ValueError, match="power of two, at least 16"):
        KernelConfig.parse("24x64")
