"""Paged attention on CUDA without flash-attn: one Triton kernel for decodes and prompt chunks.

Runs in worker processes. Where flash-attn cannot run (not installed, a block size that is not a
multiple of 256, float32, attention sinks), the torch backend gathers every decode's context and
runs a prompt chunk per SDPA call: a dozen launches per layer and copies of the whole context.
This kernel reads K/V through the block table where they lie, in the torch backend's cache layout
``(2, num_kv_heads, num_blocks, block_size, head_dim)``, so the two share the write path and
their caches are interchangeable.

One program takes one tile of a request's query tokens for one KV head: the tile's tokens times
the query heads sharing that KV head are the rows of its score matrix (GQA costs no repeated K/V
reads), and it walks the request's keys in tiles with an online softmax (no score matrix in
memory), stopping at the tile's last query position (causal) and starting at the window's first
key (sliding window). A soft-cap (Gemma 2) and a sink logit per head (gpt-oss) are applied in the
same pass. The host splits each request into tiles from the metadata's host copies, once a step
for all layers, so nothing waits on the device.

Two exceptions. A decode step too small to fill the GPU (one program per request and KV head:
Qwen3-0.6B at batch 1 is 8 programs on an H200's 132 multiprocessors) splits each request's keys
into runs that a second kernel merges (split-K, ``decode_segments``). A long prompt chunk with
nothing cached before it goes to SDPA's causal kernel on its own keys (``_fresh_long_prompts``),
which on an H200 ran such chunks of 2k-8k tokens 1.4-2.3x as fast as this kernel.

Tested against the torch backend on CPU through Triton's interpreter (TRITON_INTERPRET=1) and on
CUDA (tests/worker/test_triton_attention.py).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from conveyor.worker.attention.backend import AttentionBackend, AttentionMetadata
from conveyor.worker.attention.torch_backend import TorchAttentionBackend, as_cached
from conveyor.worker.cuda_graphs import MAX_CAPTURE_SIZE
from conveyor.worker.device_buffers import array_to_device

# Score-matrix rows per program: a decode-only step has one token per request, so its tiles are
# the GQA group padded to the 16 rows tl.dot needs; prompt chunks take 64 rows (tokens x group).
_DECODE_ROWS = 16
_PREFILL_ROWS = 64
_KEYS_PER_TILE = 64


@dataclass(frozen=True)
class KernelConfig:
    """The paged-attention kernel's tile shape and launch settings, where the defaults are not
    wanted (``python -m benchmarks attention --triton-configs`` times several side by side): score
    rows per program, keys per step of its loop (powers of two, at least 16, the smallest
    ``tl.dot`` takes), and Triton's warps and software-pipeline stages (None: Triton's)."""

    rows: int | None = None
    keys: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self) -> None:
        for name in ("rows", "keys"):
            value = getattr(self, name)
            if value is not None and (value < 16 or value & (value - 1)):
                raise ValueError(f"{name} must be a power of two, at least 16; got {value}")

    @classmethod
    def parse(cls, text: str) -> KernelConfig:
        """``ROWSxKEYS[/wWARPS][/sSTAGES]``, e.g. ``64x64`` or ``128x32/w8/s3``."""
        shape, *settings = text.split("/")
        try:
            rows, keys = (int(n) for n in shape.split("x"))
            launch = {"w": None, "s": None}
            for setting in settings:
                if setting[:1] not in launch:
                    raise ValueError(setting)
                launch[setting[0]] = int(setting[1:])
        except ValueError:
            raise ValueError(
                f"kernel config {text!r}: expected ROWSxKEYS[/wWARPS][/sSTAGES], e.g. 128x32/w8/s3"
            ) from None
        return cls(rows, keys, launch["w"], launch["s"])

    def launch_options(self) -> dict[str, int]:
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        return {name: value for name, value in options.items() if value is not None}


_DEFAULT_CONFIG = KernelConfig()
# Prompt chunks with nothing cached before them, of at least this many tokens, go to SDPA.
_SDPA_MIN_CHUNK = 1024
# Split-K for decode steps: at most this many runs of each request's keys (a power of two).
_MAX_SEGMENTS = 16


def decode_segments(num_reqs: int, num_kv_heads: int, multiprocessors: int) -> int:
    """How many runs a decode step splits each request's keys into: 1 (no split) once its
    (request, KV head) programs fill the device's multiprocessors, else the largest power of two
    that keeps them at most two per multiprocessor, at most _MAX_SEGMENTS. One program per request
    and KV head leaves a GPU mostly idle at small batches: Qwen3-0.6B's 8 KV heads at batch 1
    are 8 programs on an H200's 132 multiprocessors, each reading the whole context alone."""
    programs = num_reqs * num_kv_heads
    if programs == 0 or programs >= multiprocessors:
        return 1
    wanted = 2 * multiprocessors // programs  # at least 2: programs < multiprocessors
    return min(_MAX_SEGMENTS, 1 << (wanted.bit_length() - 1))


# Steps whose longest query chunk has at least _LONG_CHUNK tokens, in a 2-byte dtype with heads
# of at most 128 dims, take bigger tiles: on two H200s 128 x 128 with 8 warps and 3 stages was
# 4-9% faster than the defaults on chunks of 2k and 8k tokens after 0 and 8k cached ones, and
# 13% slower on a 512-token chunk beside 63 decodes (every decode's tile gets those rows),
# hence the threshold. float32 tiles of that size would need twice the shared memory.
_LONG_CHUNK = 1024
_LONG_CHUNK_CONFIG = KernelConfig(128, 128, num_warps=8, num_stages=3)


@functools.cache
def triton_import_error() -> str | None:
    """Why Triton cannot be used here (None when it can)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any import failure means "not here"
        return f"{type(error).__name__}: {error}"
    return None


def triton_unusable_reason(device: torch.device) -> str | None:
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"it needs a CUDA device, this is {device.type}"
    import_error = triton_import_error()
    if import_error is not None:
        return f"triton does not import ({import_error})"
    return None


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def _kernels():
    """The jitted kernels; their module is imported on first use, not with this one."""
    from conveyor.worker.attention import triton_kernel

    return triton_kernel


class _TilePlan:
    """Each program's request and first query token, on the device; shared by a step's layers."""

    def __init__(self, query_lens: np.ndarray, rows: int, group: int, device) -> None:
        """``query_lens``: each request's tokens to tile (0: none, its rows come from elsewhere)."""
        tokens_per_tile = max(1, rows // group)
        tiles = -(-query_lens // tokens_per_tile)
        self.tile_req = np.repeat(np.arange(len(query_lens), dtype=np.int32), tiles)
        first_tile = np.cumsum(tiles) - tiles
        index_in_req = np.arange(len(self.tile_req)) - np.repeat(first_tile, tiles)
        tile_start = (index_in_req * tokens_per_tile).astype(np.int32)
        self.num_tiles = len(self.tile_req)
        self.tile_req_dev = array_to_device(self.tile_req, device)
        self.tile_start_dev = array_to_device(tile_start, device)


def _decode_tiles(size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Tile i takes request i's one token: requests 0, 1, 2, ... and first tokens 0."""
    return (
        torch.arange(size, dtype=torch.int32, device=device),
        torch.zeros(size, dtype=torch.int32, device=device),
    )


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    # forward(..., out=buffer) writes the output there (a dense [tokens, heads, head_dim]).
    accepts_out = True

    # A decode-only step's attention reads nothing the host plans per step (one tile per
    # request, from fixed buffers), so it can run inside a CUDA graph with the rest of the
    # forward; a padding request (no context, slot -1) writes zeros to its row and nothing else.
    full_decode_graphs = True

    def __init__(self, config: KernelConfig | None = None) -> None:
        # None: the defaults, decode and prompt steps each their own tile shape.
        self.config = config
        self._plan_key: tuple[object, ...] | None = None
        self._plan: _TilePlan | None = None
        # 0, 1, 2, ... and zeros: a decode step's tiles, request i's one token in tile i.
        self._decode_tiles: tuple[torch.Tensor, torch.Tensor] | None = None
        # Fresh prompt chunks of at least this many tokens go to SDPA (_fresh_long_prompts).
        self.sdpa_min_chunk = _SDPA_MIN_CHUNK
        # The device's multiprocessors, which split-K decode fills (None: asked of the device
        # at the first decode; 0 on a CPU, which never splits unless a test sets it).
        self.multiprocessors: int | None = None
        # Split-K partial outputs, one pair per (heads, KV heads, head_dim, device), sized once
        # for the largest split step: CUDA graphs hold their address.
        self._workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    # The torch backend's layout, from its one definition: the two read and write the same cache.
    kv_cache_shape = staticmethod(TorchAttentionBackend.kv_cache_shape)

    def _plan_for(
        self, metadata: AttentionMetadata, rows: int, group: int, device, skip: np.ndarray | None
    ) -> _TilePlan:
        query_lens = np.diff(metadata.query_start_loc_cpu)
        if skip is not None:
            query_lens = np.where(skip, 0, query_lens)
        key = (query_lens.tobytes(), rows, group, str(device))
        if self._plan is None or key != self._plan_key:
            self._plan = _TilePlan(query_lens, rows, group, device)
            self._plan_key = key
        return self._plan

    def _sdpa_serves(self, query: torch.Tensor) -> bool:
        # SDPA's fast causal kernels on CUDA take 2-byte dtypes; the tests force it on CPU.
        return query.is_cuda and query.dtype.itemsize == 2

    def _fresh_long_prompts(
        self, metadata: AttentionMetadata, query: torch.Tensor, plain: bool
    ) -> np.ndarray | None:
        """Which requests' chunks are their whole context and at least ``sdpa_min_chunk``
        tokens long (None: none, or the step cannot use SDPA): those go to SDPA's causal kernel
        on the chunk's own keys, which on an H200 was 1.4x (2k tokens) to 2.3x (8k) faster than
        this kernel; with keys cached before the chunk the two were even, and this kernel
        reads them in place where SDPA would need them gathered."""
        if not plain or self.config is not None or metadata.max_query_len < self.sdpa_min_chunk:
            return None
        if not self._sdpa_serves(query):
            return None
        query_lens = np.diff(metadata.query_start_loc_cpu)
        fresh = (query_lens >= self.sdpa_min_chunk) & (
            metadata.seq_lens_cpu[: len(query_lens)] == query_lens
        )
        return fresh if fresh.any() else None

    def kernel_config(self, max_query_len: int, head_dim: int, dtype: torch.dtype) -> KernelConfig:
        """The tile shape and launch settings of a step: the configured ones, else the
        long-chunk ones for a step with a long prompt chunk (see _LONG_CHUNK), else the
        defaults."""
        if self.config is not None:
            return self.config
        if max_query_len >= _LONG_CHUNK and head_dim <= 128 and dtype.itemsize == 2:
            return _LONG_CHUNK_CONFIG
        return _DEFAULT_CONFIG

    def _segments_for(self, num_reqs: int, num_kv_heads: int, device) -> int:
        if self.config is not None:
            return 1  # a configured shape (bench attention) is timed as it is
        if self.multiprocessors is None:
            self.multiprocessors = _multiprocessors(torch.device(device))
        return decode_segments(num_reqs, num_kv_heads, self.multiprocessors)

    def _workspace(
        self, num_heads: int, num_kv_heads: int, head_dim: int, device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 partial outputs [tokens, heads, segments, head_dim] and (max, sum) pairs for
        the largest tokens x segments any split decode step takes, allocated once."""
        key = (num_heads, num_kv_heads, head_dim, str(device))
        if key not in self._workspaces:
            sms = self.multiprocessors
            most = max(n * decode_segments(n, num_kv_heads, sms) for n in range(1, sms + 1))
            part = torch.empty(most * num_heads * head_dim, dtype=torch.float32, device=device)
            ml = torch.empty(most * num_heads * 2, dtype=torch.float32, device=device)
            self._workspaces[key] = (part, ml)
        return self._workspaces[key]

    def _decode_tiles_for(self, num_reqs: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        tiles = self._decode_tiles
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            # "cuda" names the current device; its tensors say "cuda:0": compare those.
            device = torch.device("cuda", torch.cuda.current_device())
        if tiles is None or tiles[0].device != device:
            # The largest captured batch: the graphs' warm-up allocates it, not a capture. Made
            # once and never replaced, because the whole-forward graphs hold its address.
            tiles = _decode_tiles(MAX_CAPTURE_SIZE, device)
            self._decode_tiles = tiles
        if num_reqs > len(tiles[0]):
            # An eager step larger than any graph: tiles of its own, the graphs' left alone.
            tiles = _decode_tiles(num_reqs, device)
        return tiles[0][:num_reqs], tiles[1][:num_reqs]

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num_tokens = metadata.num_actual_tokens
        _, num_kv_heads, _, block_size, head_dim = kv_cache.shape
        head_dim_pad = max(16, 1 << (head_dim - 1).bit_length())
        kernels = _kernels()
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if num_tokens:
            # The kernel reads a head's dims contiguously (a view into a fused qkv output is).
            key = key if key.stride(-1) == 1 else key.contiguous()
            value = value if value.stride(-1) == 1 else value.contiguous()
            kernels.store_kv[(num_tokens, num_kv_heads)](
                key,
                value,
                k_cache,
                v_cache,
                metadata.slot_mapping,
                key.stride(0),
                key.stride(1),
                value.stride(0),
                value.stride(1),
                k_cache.stride(0),
                k_cache.stride(1),
                k_cache.stride(2),
                HEAD_DIM=head_dim,
                HEAD_DIM_PAD=head_dim_pad,
                BLOCK_SIZE=block_size,
            )
        # Into the caller's buffer when it has one (a graph piece's input: no copy after).
        if out is None:
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        output = out
        output[num_tokens:].zero_()
        if num_tokens == 0:
            return output
        if query.stride(-1) != 1:
            query = query.contiguous()
        group = query.shape[1] // num_kv_heads
        # The longest chunk this kernel tiles: long fresh prompt chunks go to SDPA instead.
        tiled_len, fresh = metadata.max_query_len, None
        if tiled_len > 1:
            plain = sliding_window is None and sinks is None and softcap is None
            fresh = self._fresh_long_prompts(metadata, query, plain)
            if fresh is not None:
                _attend_with_sdpa(query, key, value, kv_cache, metadata, fresh, scale, output)
                rest = np.diff(metadata.query_start_loc_cpu)[~fresh]
                if rest.size == 0:
                    return output
                tiled_len = int(rest.max())
        config = self.kernel_config(tiled_len, head_dim, query.dtype)
        base_rows = config.rows or (_DECODE_ROWS if tiled_len <= 1 else _PREFILL_ROWS)
        keys = config.keys or (_KEYS_PER_TILE if head_dim <= 128 else _KEYS_PER_TILE // 2)
        rows = max(base_rows, 1 << (group - 1).bit_length())
        if metadata.max_query_len <= 1:
            num_tiles = metadata.num_reqs
            tile_req, tile_start = self._decode_tiles_for(num_tiles, query.device)
        else:
            plan = self._plan_for(metadata, rows, group, query.device, fresh)
            num_tiles, tile_req, tile_start = plan.num_tiles, plan.tile_req_dev, plan.tile_start_dev
        segments = 1
        part = ml = query  # unread without segments
        if metadata.max_query_len <= 1:
            segments = self._segments_for(num_tiles, num_kv_heads, query.device)
            if segments > 1:
                part, ml = self._workspace(query.shape[1], num_kv_heads, head_dim, query.device)
        kernels.paged_attention[(num_tiles, num_kv_heads, segments)](
            query,
            k_cache,
            v_cache,
            output,
            metadata.block_table,
            metadata.seq_lens,
            metadata.query_start_loc,
            tile_req,
            tile_start,
            sinks if sinks is not None else query,  # unread without USE_SINKS
            part,
            ml,
            scale,
            float(softcap or 0.0),
            int(sliding_window or 0),
            query.shape[1],
            query.stride(0),
            query.stride(1),
            output.stride(0),
            output.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            metadata.block_table.stride(0),
            GROUP=group,
            ROWS=rows,
            KEYS=keys,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            BLOCK_SIZE=block_size,
            USE_WINDOW=sliding_window is not None,
            USE_SOFTCAP=softcap is not None,
            USE_SINKS=sinks is not None,
            PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
            SEGMENTS=segments,
            **config.launch_options(),
        )
        if segments > 1:
            kernels.reduce_segments[(num_tiles, query.shape[1])](
                part,
                ml,
                output,
                sinks if sinks is not None else query,
                output.stride(0),
                output.stride(1),
                SEGMENTS=segments,
                HEAD_DIM=head_dim,
                HEAD_DIM_PAD=head_dim_pad,
                USE_SINKS=sinks is not None,
            )
        return output


def _attend_with_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    fresh: np.ndarray,
    scale: float,
    output: torch.Tensor,
) -> None:
    """Each ``fresh`` request's chunk (its whole context) through SDPA's causal kernel on its own
    keys, as the torch backend does it: the keys as the cache holds them, so the numbers are the
    ones a later step reads back."""
    starts = metadata.query_start_loc_cpu
    for request in np.flatnonzero(fresh):
        start, end = int(starts[request]), int(starts[request + 1])
        q = query[start:end].transpose(0, 1).unsqueeze(0)
        k = as_cached(key[start:end], kv_cache).transpose(0, 1).unsqueeze(0)
        v = as_cached(value[start:end], kv_cache).transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        output[start:end] = out[0].transpose(0, 1)
