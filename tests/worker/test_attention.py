"""Paged attention backends against dense causal attention written out here, plus selection.

The torch backend's tests run twice: on its pure-torch path and with the compiled CPU kernel
(skipped only where the kernel cannot be built; test_cpu_kernel.py fails loudly if it should be).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from conveyor.worker.attention import selector
from conveyor.worker.attention.cpu_kernel import PagedAttentionKernel, load_kernel
from conveyor.worker.attention.flash_attn_backend import FlashAttnBackend, flash_attn_import_error
from conveyor.worker.attention.metadata_builder import build_attention_metadata
from conveyor.worker.attention.selector import flash_attn_unusable_reason, select_backend
from conveyor.worker.attention.torch_backend import TorchAttentionBackend
from conveyor.worker.attention.triton_backend import TritonAttentionBackend

HEAD_DIM = 16
CPU = torch.device("cpu")


@dataclass
class Request:
    """One request's whole K/V history (cached prefix, then this step's tokens) and its query."""

    num_computed: int
    keys: torch.Tensor  # [seq_len, kv_heads, dim]
    values: torch.Tensor
    query: torch.Tensor  # [num_scheduled, heads, dim]
    block_ids: list[int]

    @property
    def num_scheduled(self) -> int:
        return self.query.shape[0]


def make_request(
    gen, num_computed, num_scheduled, num_heads, num_kv_heads, block_ids, dtype, head_dim=HEAD_DIM
):
    seq_len = num_computed + num_scheduled
    return Request(
        num_computed=num_computed,
        keys=torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype),
        values=torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype),
        query=torch.randn(num_scheduled, num_heads, head_dim, generator=gen).to(dtype),
        block_ids=block_ids,
    )


def make_requests(gen, pool, shapes, block_size, num_heads, num_kv_heads, dtype, head_dim=HEAD_DIM):
    """One request per (cached prefix, scheduled tokens) shape, each on the next blocks of
    ``pool`` (a shuffled list of block ids, so a request's blocks are scattered)."""
    requests = []
    for num_computed, num_scheduled in shapes:
        n = -(-(num_computed + num_scheduled) // block_size)
        block_ids, pool = pool[:n], pool[n:]
        requests.append(
            make_request(
                gen,
                num_computed,
                num_scheduled,
                num_heads,
                num_kv_heads,
                block_ids,
                dtype,
                head_dim,
            )  # fmt: skip
        )
    return requests


class KernelSpy:
    """Stands in for the compiled kernel and counts its calls, so a test knows which path ran."""

    def __init__(self, kernel: PagedAttentionKernel) -> None:
        self.kernel = kernel
        self.dtype, self.kv_dtype = kernel.dtype, kernel.kv_dtype
        self.num_calls = 0
        self.supports = kernel.supports
        self.write_kv = kernel.write_kv
        self.max_rows, self.tiles_per_item = kernel.max_rows, kernel.tiles_per_item
        self.queries_per_item = kernel.queries_per_item

    def attend(self, *args) -> None:
        self.num_calls += 1
        self.kernel.attend(*args)


@pytest.fixture(params=["kernel", "torch ops"])
def make_backend(request):
    """A TorchAttentionBackend factory for one path; the kernel path's backends carry a spy."""

    def make(**kwargs) -> TorchAttentionBackend:
        if request.param == "torch ops":
            return TorchAttentionBackend(use_cpu_kernel=False, **kwargs)
        kernel = load_kernel()
        if kernel is None:
            pytest.skip("the CPU kernel cannot be built here")
        backend = TorchAttentionBackend(**kwargs)
        backend.cpu_kernel = KernelSpy(kernel)
        return backend

    return make


def assert_path_ran(backend: TorchAttentionBackend, requests: list[Request]) -> None:
    """The kernel path called the kernel (it takes every query, short or long); the torch path
    never loaded it."""
    if isinstance(backend.cpu_kernel, KernelSpy):
        assert requests and backend.cpu_kernel.num_calls > 0
    else:
        assert backend.cpu_kernel is None


def reference_attention(
    request: Request,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Dense causal attention of the request's queries over its full history, in float64; with a
    window W, query p sees only keys p - W + 1 .. p; ``sinks`` [heads] join each softmax as an
    extra logit with a zero value (gpt-oss); ``softcap`` c maps each score s to c * tanh(s / c)
    (Gemma 2)."""
    num_heads, num_kv_heads = request.query.shape[1], request.keys.shape[1]
    group = num_heads // num_kv_heads
    keys = request.keys.double().repeat_interleave(group, dim=1).transpose(0, 1)
    values = request.values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    query = request.query.double().transpose(0, 1)
    scores = query @ keys.transpose(1, 2) * scale  # [heads, num_scheduled, seq_len]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    positions = request.num_computed + torch.arange(request.num_scheduled)
    distance = positions[:, None] - torch.arange(keys.shape[1])[None, :]
    visible = distance >= 0
    if sliding_window is not None:
        visible &= distance < sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink_column = sinks.double().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
        probs = torch.cat([scores, sink_column], dim=-1).softmax(-1)[..., :-1]
        return (probs @ values).transpose(0, 1)
    return (scores.softmax(-1) @ values).transpose(0, 1)


def step_inputs(requests: list[Request], block_size: int, device=CPU):
    """Metadata and the flat query/key/value of this step's tokens (after each cached prefix)."""
    width = max(len(r.block_ids) for r in requests)
    table = np.zeros((len(requests), width), dtype=np.int32)
    for i, r in enumerate(requests):
        table[i, : len(r.block_ids)] = r.block_ids
    metadata, positions = build_attention_metadata(
        np.array([r.num_scheduled for r in requests], dtype=np.int32),
        np.array([r.num_computed for r in requests], dtype=np.int32),
        table,
        block_size,
        device,
    )
    query = torch.cat([r.query for r in requests]).to(device)
    key = torch.cat([r.keys[r.num_computed :] for r in requests]).to(device)
    value = torch.cat([r.values[r.num_computed :] for r in requests]).to(device)
    return metadata, positions, query, key, value


def slot_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """The torch backend's documented layout, indexed by slot: [2, kv_heads, slots, dim]."""
    _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
    return kv_cache.view(2, num_kv_heads, num_blocks * block_size, head_dim)


def store_prefix(kv_cache: torch.Tensor, request: Request, block_size: int, start=0) -> None:
    """Put the request's cached prefix (from ``start``) where earlier steps would have put it."""
    positions = np.arange(start, request.num_computed)
    blocks = np.array(request.block_ids, dtype=np.int64)[positions // block_size]
    slots = torch.from_numpy(blocks * block_size + positions % block_size)
    slot_view(kv_cache)[0][:, slots] = request.keys[start : request.num_computed].transpose(0, 1)
    slot_view(kv_cache)[1][:, slots] = request.values[start : request.num_computed].transpose(0, 1)


def random_mixed_batch(seed, block_size, num_heads, num_kv_heads, num_reqs=7, head_dim=HEAD_DIM):
    """Decodes and prompt chunks with random cached prefixes on shuffled, scattered blocks."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    shapes = []
    for i in range(num_reqs):
        is_decode = i % 2 == 0 if i < 2 else rng.random() < 0.5
        num_computed = int(rng.integers(0, 70)) if is_decode or rng.random() < 0.7 else 0
        num_scheduled = 1 if is_decode else int(rng.integers(2, 40))
        shapes.append((num_computed, num_scheduled))
    num_blocks = sum(-(-(c + s) // block_size) for c, s in shapes) + 5
    pool = rng.permutation(num_blocks).tolist()
    requests = make_requests(
        gen, pool, shapes, block_size, num_heads, num_kv_heads, torch.float32, head_dim
    )
    return requests, num_blocks


def run_torch_backend(backend, requests, num_blocks, block_size, num_kv_heads, sliding_window=None):
    head_dim = requests[0].query.shape[-1]
    kv_cache = torch.zeros(
        TorchAttentionBackend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    )
    for r in requests:
        store_prefix(kv_cache, r, block_size)
    metadata, _, query, key, value = step_inputs(requests, block_size)
    output = backend.forward(query, key, value, kv_cache, metadata, head_dim**-0.5, sliding_window)
    return output, kv_cache, metadata, key, value


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2), (16, 1)])
@pytest.mark.parametrize("small_decode_chunks", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_torch_backend_matches_dense_reference_on_mixed_batch(
    make_backend, block_size, num_heads, num_kv_heads, small_decode_chunks, seed
):
    requests, num_blocks = random_mixed_batch(seed, block_size, num_heads, num_kv_heads)
    # A budget of ~100 context tokens per chunk splits the decodes into chunks of differing
    # padded lengths; the default budget puts them all in one.
    chunk_bytes = 100 * 2 * num_kv_heads * HEAD_DIM * 4 if small_decode_chunks else None
    backend = make_backend(decode_chunk_bytes=chunk_bytes)
    output, kv_cache, metadata, key, value = run_torch_backend(
        backend, requests, num_blocks, block_size, num_kv_heads
    )
    expected = torch.cat([reference_attention(r, HEAD_DIM**-0.5) for r in requests])
    torch.testing.assert_close(output, expected.float(), atol=1e-5, rtol=1e-5)
    assert_path_ran(backend, requests)
    slots = metadata.slot_mapping
    torch.testing.assert_close(slot_view(kv_cache)[0][:, slots], key.transpose(0, 1))
    torch.testing.assert_close(slot_view(kv_cache)[1][:, slots], value.transpose(0, 1))


@pytest.mark.parametrize("sliding_window", [1, 5, 24, 37])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("small_decode_chunks", [False, True])
def test_sliding_window_matches_dense_reference_on_mixed_batch(
    make_backend, sliding_window, block_size, small_decode_chunks
):
    requests, num_blocks = random_mixed_batch(7, block_size, 8, 2, num_reqs=9)
    chunk_bytes = 100 * 2 * 2 * HEAD_DIM * 4 if small_decode_chunks else None
    backend = make_backend(decode_chunk_bytes=chunk_bytes)
    output, *_ = run_torch_backend(backend, requests, num_blocks, block_size, 2, sliding_window)
    expected = torch.cat([reference_attention(r, HEAD_DIM**-0.5, sliding_window) for r in requests])
    torch.testing.assert_close(output, expected.float(), atol=1e-5, rtol=1e-5)
    assert_path_ran(backend, requests)


@pytest.mark.parametrize("sliding_window", [None, 13])
@pytest.mark.parametrize("small_decode_chunks", [False, True])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
def test_attention_sinks_match_dense_reference_on_mixed_batch(
    make_backend, sliding_window, small_decode_chunks, num_heads, num_kv_heads
):
    requests, num_blocks = random_mixed_batch(3, 16, num_heads, num_kv_heads, num_reqs=8)
    # Large and small sinks: from "attention mostly goes nowhere" to "no effect".
    sinks = torch.linspace(-4.0, 6.0, num_heads)
    chunk_bytes = 100 * 2 * num_kv_heads * HEAD_DIM * 4 if small_decode_chunks else None
    backend = make_backend(decode_chunk_bytes=chunk_bytes)
    kv_cache = torch.zeros(
        TorchAttentionBackend.kv_cache_shape(num_blocks, 16, num_kv_heads, HEAD_DIM)
    )
    for r in requests:
        store_prefix(kv_cache, r, 16)
    metadata, _, query, key, value = step_inputs(requests, 16)
    output = backend.forward(query, key, value, kv_cache, metadata, 0.25, sliding_window, sinks)
    expected = torch.cat([reference_attention(r, 0.25, sliding_window, sinks) for r in requests])
    torch.testing.assert_close(output, expected.float(), atol=1e-5, rtol=1e-5)
    assert_path_ran(backend, requests)
    # The sinks matter: without them the same batch attends differently.
    plain = torch.cat([reference_attention(r, 0.25, sliding_window) for r in requests])
    assert not torch.allclose(plain.float(), expected.float(), atol=1e-3)


@pytest.mark.parametrize("sliding_window", [None, 13])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_a_logit_softcap_matches_dense_reference_on_mixed_batch(
    make_backend, sliding_window, with_sinks
):
    requests, num_blocks = random_mixed_batch(9, 16, 8, 2, num_reqs=8)
    # Large queries, so the scores spread past the cap and the tanh bends them.
    for r in requests:
        r.query.mul_(4.0)
    sinks = torch.linspace(-2.0, 3.0, 8) if with_sinks else None
    softcap = 2.5
    backend = make_backend(decode_chunk_bytes=100 * 2 * 2 * HEAD_DIM * 4)
    kv_cache = torch.zeros(TorchAttentionBackend.kv_cache_shape(num_blocks, 16, 2, HEAD_DIM))
    for r in requests:
        store_prefix(kv_cache, r, 16)
    metadata, _, query, key, value = step_inputs(requests, 16)
    output = backend.forward(
        query, key, value, kv_cache, metadata, 0.25, sliding_window, sinks, softcap
    )
    expected = torch.cat(
        [reference_attention(r, 0.25, sliding_window, sinks, softcap) for r in requests]
    )
    torch.testing.assert_close(output, expected.float(), atol=1e-5, rtol=1e-5)
    assert_path_ran(backend, requests)
    uncapped = torch.cat([reference_attention(r, 0.25, sliding_window, sinks) for r in requests])
    assert not torch.allclose(uncapped.float(), expected.float(), atol=1e-3)


def test_flash_attn_is_ruled_out_for_a_model_with_sinks():
    with pytest.raises(ValueError, match="sinks"):
        select_backend(torch.device("cuda"), 256, "flash-attn", torch.bfloat16, needs_sinks=True)


def test_sliding_window_never_reads_the_blocks_behind_it(make_backend):
    """Blocks wholly behind every query's window may be freed and reused by another request, so
    what they hold must not matter: NaN there (the kernel and prompt chunks never read them;
    decode chunks read and mask them, so for them it is another request's finite junk)."""
    block_size, window, num_heads, num_kv_heads = 16, 20, 4, 2
    gen = torch.Generator().manual_seed(11)
    # A decode at position 70 sees 51..70 (blocks 3, 4); a 30-token chunk at 40..69 sees 21..69
    # (blocks 1..4); a 20-token chunk at 100..119 sees 81..119 (blocks 5..7).
    requests = [
        make_request(gen, 70, 1, num_heads, num_kv_heads, [1, 2, 3, 4, 5], torch.float32),
        make_request(gen, 40, 30, num_heads, num_kv_heads, [6, 7, 8, 9, 10], torch.float32),
        make_request(gen, 100, 20, num_heads, num_kv_heads, list(range(11, 19)), torch.float32),
    ]
    kv_cache = torch.zeros(TorchAttentionBackend.kv_cache_shape(19, block_size, 2, HEAD_DIM))
    for r in requests:
        store_prefix(kv_cache, r, block_size)
    backend = make_backend()
    decode_junk = float("nan") if isinstance(backend.cpu_kernel, KernelSpy) else 1e4
    blocks = kv_cache[:, :]
    for block_id, junk in ((1, decode_junk), (2, decode_junk), (6, float("nan"))):
        blocks[:, :, block_id] = junk
    for block_id in range(11, 16):
        blocks[:, :, block_id] = float("nan")
    metadata, _, query, key, value = step_inputs(requests, block_size)
    output = backend.forward(query, key, value, kv_cache, metadata, 0.25, window)
    expected = torch.cat([reference_attention(r, 0.25, window) for r in requests])
    torch.testing.assert_close(output, expected.float(), atol=1e-5, rtol=1e-5)


def test_torch_backend_reads_prefix_blocks_written_by_another_request_in_the_same_step(
    make_backend,
):
    block_size, num_heads, num_kv_heads = 16, 4, 2
    gen = torch.Generator().manual_seed(3)
    # The owner prefills 40 tokens into blocks 7, 2, 9; its first two blocks (32 tokens) are the
    # shared prefix of the two requests placed before it in the batch.
    owner = make_request(gen, 0, 40, num_heads, num_kv_heads, [7, 2, 9], torch.float32)
    decode = make_request(gen, 45, 1, num_heads, num_kv_heads, [7, 2, 4], torch.float32)
    chunk = make_request(gen, 32, 10, num_heads, num_kv_heads, [7, 2, 5], torch.float32)
    for sharer in (decode, chunk):
        sharer.keys[:32], sharer.values[:32] = owner.keys[:32], owner.values[:32]
    kv_cache = torch.zeros(TorchAttentionBackend.kv_cache_shape(10, block_size, num_kv_heads, 16))
    # Only the decode's own tokens 32..44 are cached; the shared blocks are still empty.
    store_prefix(kv_cache, decode, block_size, start=32)
    requests = [decode, chunk, owner]
    metadata, _, query, key, value = step_inputs(requests, block_size)
    backend = make_backend()
    output = backend.forward(query, key, value, kv_cache, metadata, 0.25)
    expected = torch.cat([reference_attention(r, 0.25) for r in requests])
    torch.testing.assert_close(output, expected.float(), atol=1e-5, rtol=1e-5)
    assert_path_ran(backend, requests)


@pytest.mark.parametrize("split", [1, 23, 32, 40, 49])
def test_prompt_split_into_two_chunks_equals_one_call(make_backend, split):
    block_size, num_heads, num_kv_heads, prompt_len = 16, 4, 2, 50
    gen = torch.Generator().manual_seed(split)
    whole = make_request(gen, 0, prompt_len, num_heads, num_kv_heads, [3, 0, 6, 1], torch.float32)
    neighbour = make_request(gen, 20, 1, num_heads, num_kv_heads, [5, 2], torch.float32)
    shape = TorchAttentionBackend.kv_cache_shape(8, block_size, num_kv_heads, HEAD_DIM)
    backend = make_backend()

    one_cache = torch.zeros(shape)
    store_prefix(one_cache, neighbour, block_size)
    metadata, _, query, key, value = step_inputs([whole, neighbour], block_size)
    one_call = backend.forward(query, key, value, one_cache, metadata, 0.25)[:prompt_len]

    two_cache = torch.zeros(shape)
    store_prefix(two_cache, neighbour, block_size)
    first = Request(0, whole.keys[:split], whole.values[:split], whole.query[:split], [3, 0, 6, 1])
    second = Request(split, whole.keys, whole.values, whole.query[split:], [3, 0, 6, 1])
    outputs = []
    for chunk in ([first, neighbour], [second]):
        metadata, _, query, key, value = step_inputs(chunk, block_size)
        outputs.append(backend.forward(query, key, value, two_cache, metadata, 0.25))
    two_calls = torch.cat([outputs[0][:split], outputs[1]])

    torch.testing.assert_close(two_calls, one_call, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(two_cache, one_cache)
    torch.testing.assert_close(one_call, reference_attention(whole, 0.25).float())


def test_padded_tokens_after_the_actual_ones_come_out_zero(make_backend):
    requests, num_blocks = random_mixed_batch(5, 16, 4, 2, num_reqs=3)
    kv_cache = torch.zeros(TorchAttentionBackend.kv_cache_shape(num_blocks, 16, 2, HEAD_DIM))
    metadata, _, query, key, value = step_inputs(requests, 16)
    pad = 3
    query = torch.cat([query, torch.randn(pad, *query.shape[1:])])
    key = torch.cat([key, torch.randn(pad, *key.shape[1:])])
    value = torch.cat([value, torch.randn(pad, *value.shape[1:])])
    output = make_backend().forward(query, key, value, kv_cache, metadata, 0.25)
    assert output.shape == query.shape
    assert torch.count_nonzero(output[-pad:]) == 0
    assert torch.count_nonzero(output[:-pad].abs().sum(-1) == 0) == 0


def test_selector_picks_torch_on_cpu_and_refuses_forced_flash_attn():
    assert isinstance(select_backend(CPU, 16), TorchAttentionBackend)
    assert isinstance(select_backend(CPU, 256, "torch"), TorchAttentionBackend)
    with pytest.raises(ValueError, match="CUDA"):
        select_backend(CPU, 256, "flash-attn")
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend(CPU, 16, "xformers")


def test_forced_backends_run_as_named_or_fail_saying_why(monkeypatch):
    torch_ops = select_backend(CPU, 16, "torch")
    assert isinstance(torch_ops, TorchAttentionBackend) and torch_ops._use_cpu_kernel is False
    if load_kernel() is not None:
        kernel = select_backend(CPU, 16, "cpu-kernel")
        assert isinstance(kernel, TorchAttentionBackend) and kernel._use_cpu_kernel is True
    with pytest.raises(ValueError, match="CPU only"):
        select_backend(torch.device("cuda"), 256, "cpu-kernel")
    monkeypatch.setenv("CONVEYOR_CPU_KERNEL", "0")
    with pytest.raises(ValueError, match="CONVEYOR_CPU_KERNEL=0"):
        select_backend(CPU, 16, "cpu-kernel")


def test_falling_back_to_torch_ops_on_cuda_is_a_warning_naming_the_fix(caplog, monkeypatch):
    # Building the torch backend touches no device, so this runs anywhere.
    monkeypatch.setattr(selector, "triton_unusable_reason", lambda device: "no triton here")
    with caplog.at_level("WARNING", logger="conveyor.worker.attention.selector"):
        backend = select_backend(torch.device("cuda"), 16, None, torch.bfloat16)
    assert isinstance(backend, TorchAttentionBackend)
    (record,) = [r for r in caplog.records if r.levelname == "WARNING"]
    assert "multiple of 256" in record.getMessage() and "--block-size" in record.getMessage()
    assert "no triton here" in record.getMessage()
    caplog.clear()
    with caplog.at_level("INFO", logger="conveyor.worker.attention.selector"):
        select_backend(CPU, 16)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_without_flash_attn_cuda_gets_the_triton_kernel_saying_why(caplog, monkeypatch):
    monkeypatch.setattr(selector, "triton_unusable_reason", lambda device: None)
    with caplog.at_level("INFO", logger="conveyor.worker.attention.selector"):
        backend = select_backend(torch.device("cuda"), 16, None, torch.float32)
    assert isinstance(backend, TritonAttentionBackend)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert any(
        "triton" in r.getMessage() and "multiple of 256" in r.getMessage() for r in caplog.records
    )
    # Sinks rule flash-attn out, not Triton.
    assert isinstance(
        select_backend(torch.device("cuda"), 256, None, torch.bfloat16, needs_sinks=True),
        TritonAttentionBackend,
    )


def test_flash_attn_reasons_name_block_size_and_dtype():
    cuda = torch.device("cuda")
    assert "multiple of 256" in flash_attn_unusable_reason(cuda, 16, torch.bfloat16)
    assert "float16" in flash_attn_unusable_reason(cuda, 256, torch.float32)
    assert FlashAttnBackend.supports_block_size(512)
    assert not FlashAttnBackend.supports_block_size(128)
    assert FlashAttnBackend.kv_cache_shape(10, 256, 4, 64) == (2, 10, 256, 4, 64)


def _flash_usable() -> bool:
    return torch.cuda.is_available() and flash_attn_import_error() is None


@pytest.mark.cuda
@pytest.mark.skipif(not _flash_usable(), reason="needs CUDA and flash_attn")
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (8, 2)])
@pytest.mark.parametrize(
    "shapes",
    [
        # (cached before step 2, scheduled in step 2): decodes, a fresh prompt, a 2nd chunk.
        [(300, 1), (0, 200), (37, 1), (260, 90), (511, 1)],
        # Decodes only: flash-attn's single-query path (it regroups GQA heads there).
        [(300, 1), (37, 1), (511, 1), (256, 1)],
    ],
    ids=["mixed", "decodes"],
)
@pytest.mark.parametrize("sliding_window", [None, 100], ids=["global", "window-100"])
def test_flash_attn_matches_torch_backend_over_two_steps(
    num_heads, num_kv_heads, shapes, sliding_window
):
    block_size, dtype, device = 256, torch.bfloat16, torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    pool = np.random.default_rng(0).permutation(12).tolist()
    requests = make_requests(gen, pool, shapes, block_size, num_heads, num_kv_heads, dtype)
    # Step 1 fills the cached prefixes through each backend's own forward, whatever its layout.
    prefix_step = []
    for r in requests:
        if c := r.num_computed:
            prefix_query = torch.zeros(c, num_heads, HEAD_DIM, dtype=dtype)
            prefix_step.append(Request(0, r.keys[:c], r.values[:c], prefix_query, r.block_ids))
    outputs = []
    for backend in (FlashAttnBackend(), TorchAttentionBackend()):
        shape = backend.kv_cache_shape(12, block_size, num_kv_heads, HEAD_DIM)
        kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        for step in (prefix_step, requests):
            metadata, _, query, key, value = step_inputs(step, block_size, device)
            output = backend.forward(
                query, key, value, kv_cache, metadata, HEAD_DIM**-0.5, sliding_window
            )
        outputs.append(output.float().cpu())
    expected = torch.cat(
        [reference_attention(r, HEAD_DIM**-0.5, sliding_window) for r in requests]
    ).float()
    torch.testing.assert_close(outputs[0], outputs[1], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(outputs[0], expected, atol=2e-2, rtol=2e-2)


def test_the_cuda_prefill_route_with_repeated_kv_heads_equals_the_gqa_one():
    """The route CUDA takes for a masked prompt chunk (KV heads repeated, no enable_gqa, so the
    memory-efficient kernel can take the mask) gives what the GQA route gives; run on CPU."""
    from conveyor.worker.attention.torch_backend import _prefill_attention

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 8, 20, HEAD_DIM, generator=gen)
    keys, values = (torch.randn(1, 2, 50, HEAD_DIM, generator=gen) for _ in range(2))
    mask = torch.ones(20, 50, dtype=torch.bool).tril(30)
    repeated = _prefill_attention(q, keys, values, mask, 0.25, None, repeat_kv_heads=True)
    grouped = _prefill_attention(q, keys, values, mask, 0.25, None, repeat_kv_heads=False)
    torch.testing.assert_close(repeated, grouped, atol=1e-6, rtol=1e-5)
