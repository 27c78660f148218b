"""The compiled CPU paged-attention kernel: build on first use, load with ctypes, call.

Runs in worker processes. ``csrc/paged_attention.c`` (and the headers beside it) is built and
cached by ``worker.native`` (the system compiler, about a second, cached by a hash of the sources,
the flags, the compiler and the CPU). Where there is no compiler or the build fails, the reason is
logged once and the torch backend keeps its pure-torch path. ``CONVEYOR_CPU_KERNEL=0`` turns the
kernel off.

The source builds per (model dtype, cache dtype), on demand: float32; ``-DCONVEYOR_BF16`` for
bfloat16 models (bfloat16 queries, cache and output); ``-DCONVEYOR_KV_BF16`` for float32 models
over a bfloat16 cache (``--kv-cache-dtype bfloat16``: float32 queries and output, keys and values
rounded to bfloat16 as they are written). The arithmetic is float32 in all three, but for the
bfloat16 build's query tiles on a host with AMX (csrc/amx_tiles.h): there the two products run as
bfloat16 tile multiplies with float32 sums, the weights rounded to bfloat16 before the second
(``PagedAttentionKernel.amx`` says whether; ``CONVEYOR_CPU_AMX=0`` turns it off). ctypes releases
the GIL for the call; the kernel's OpenMP threads are torch's own (see ``worker.native``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import numpy as np
import torch

from conveyor.worker import native
from conveyor.worker.kv_cache import switch_from_env
from conveyor.worker.native import find_compiler

logger = logging.getLogger(__name__)

SOURCE_PATH = Path(__file__).parent / "csrc" / "paged_attention.c"
# Must match CONVEYOR_ABI_VERSION in the source: a stale or foreign build is never called.
ABI_VERSION = 12
# Must match the source's limits: head_dim (at most MAX_HEAD_DIM, a multiple of
# HEAD_DIM_MULTIPLE: 8-float vectors). Rows per query tile (query tokens x GQA group) and tiles
# per work item depend on the build (64 rows and 2 tiles with AVX-512, 32 and 1 otherwise): each
# build says (PagedAttentionKernel.max_rows, .tiles_per_item).
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8
ITEM_FIELDS = 4
_ERRORS = {-1: "unsupported shape", -2: "block id out of range", -3: "slot out of range"}
# The (query and output dtype, cache dtype) pairs it is built for, and the defines of each build.
BUILDS = {
    (torch.float32, torch.float32): (),
    (torch.bfloat16, torch.bfloat16): ("-DCONVEYOR_BF16",),
    (torch.float32, torch.bfloat16): ("-DCONVEYOR_KV_BF16",),
}

_i32, _i64, _f32, _ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_ARGTYPES = [
    _ptr, _i64, _i64,  # query, token stride, head stride
    _ptr, _i32, _i64, _i32, _i32,  # kv_cache, num_kv_heads, num_blocks, block_size, head_dim
    _i32, _ptr, _i64,  # num_heads, block_table, block_table row stride
    _ptr, _i32, _f32, _i32, _ptr, _f32,  # items, num, scale, window (0: none), sinks, softcap
    _ptr, _i64, _i32,  # output, output token stride, num_threads
]  # fmt: skip
_WRITE_ARGTYPES = [
    _ptr, _i32, _i64, _i32,  # kv_cache, num_kv_heads, num_slots, head_dim
    _ptr, _i64, _i64, _ptr, _i64, _i64,  # key, its token and head strides; value, the same
    _ptr, _i32,  # slot_mapping (int64), num_tokens
]  # fmt: skip


class PagedAttentionKernel:
    """The loaded kernel: checks what it can run, then attends straight from the paged cache."""

    def __init__(
        self, library: ctypes.CDLL, path: Path, dtype: torch.dtype, kv_dtype: torch.dtype
    ) -> None:
        self.path = path
        # Of the queries and the output, and of the cache: this build takes no other.
        self.dtype = dtype
        self.kv_dtype = kv_dtype
        # Rows of one query tile, and tiles of whole GQA groups one work item may hold.
        self.max_rows = int(library.conveyor_tile_max_rows())
        self.tiles_per_item = int(library.conveyor_tiles_per_item())
        self._function = native.status_function(library, "conveyor_paged_attention", _ARGTYPES)
        self._amx_enable = library.conveyor_amx_enable
        self._amx_enable.argtypes, self._amx_enable.restype = [ctypes.c_int], ctypes.c_int
        # Whether query tiles run on AMX: a bfloat16 build for a host with AMX, granted the tile
        # state by Linux (5.16 or later), unless CONVEYOR_CPU_AMX=0.
        self.amx = self.set_amx(amx_wanted())
        self._write = native.status_function(library, "conveyor_write_kv", _WRITE_ARGTYPES)

    def set_amx(self, on: bool) -> bool:
        """Turn the AMX path on or off (for every user of this build in the process); whether it
        is on now."""
        self.amx = bool(self._amx_enable(int(on)))
        return self.amx

    def supports(self, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether these tensors fit the kernel: CPU, this build's dtypes, dense head rows, a
        dense cache."""
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads = kv_cache.shape[1]
        return (
            kv_cache.device.type == "cpu"
            and query.device.type == "cpu"
            and kv_cache.dtype == self.kv_dtype
            and query.dtype == self.dtype
            and kv_cache.is_contiguous()
            and query.stride(2) == 1
            and head_dim <= MAX_HEAD_DIM
            and head_dim % HEAD_DIM_MULTIPLE == 0
            and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= self.max_rows
        )

    def queries_per_item(self, num_heads: int, num_kv_heads: int) -> int:
        """Query tokens per work item: ``tiles_per_item`` tiles of as many tokens as fit
        ``max_rows`` rows with the whole GQA group."""
        return self.tiles_per_item * max(1, self.max_rows // (num_heads // num_kv_heads))

    def write_kv(
        self,
        kv_cache: torch.Tensor,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rows dense
        value: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens] int64
    ) -> None:
        """Store each token's key and value at its slot; ``supports`` must hold for the cache."""
        if key.stride(2) != 1 or value.stride(2) != 1:
            key, value = key.contiguous(), value.contiguous()
        if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
            slot_mapping = slot_mapping.to(torch.int64).contiguous()
        _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
        status = self._write(
            kv_cache.data_ptr(), num_kv_heads, num_blocks * block_size, head_dim,
            key.data_ptr(), key.stride(0), key.stride(1),
            value.data_ptr(), value.stride(0), value.stride(1),
            slot_mapping.data_ptr(), len(slot_mapping),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"KV cache write failed: {_ERRORS.get(status, status)}")

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim], rows dense
        kv_cache: torch.Tensor,  # [2, num_kv_heads, num_blocks, block_size, head_dim], dense
        block_table: torch.Tensor,  # [num_reqs, max_blocks] int32
        items: np.ndarray,  # [num_items, ITEM_FIELDS] int32, from plan_batch
        scale: float,
        output: torch.Tensor,  # [num_tokens, num_heads, head_dim], dense
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,  # [num_heads] float32
        softcap: float | None = None,
    ) -> None:
        """Write each item's query rows of ``output``; ``supports`` must hold for the inputs.

        With ``sliding_window`` W a query at position p reads only the keys at p - W + 1 .. p;
        ``sinks`` (one logit per head) join every row's softmax denominator; ``softcap`` c maps
        each score s to c * tanh(s / c)."""
        if sinks is not None:
            sinks = sinks.detach().to(torch.float32).contiguous()
            if sinks.shape != (query.shape[1],):
                raise ValueError(f"sinks must be [{query.shape[1]}], got {tuple(sinks.shape)}")
        if not output.is_contiguous():
            raise ValueError("the kernel writes a dense [num_tokens, num_heads, head_dim] output")
        if block_table.dtype != torch.int32 or not block_table.is_contiguous():
            block_table = block_table.to(torch.int32).contiguous()
        _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
        status = self._function(
            query.data_ptr(), query.stride(0), query.stride(1),
            kv_cache.data_ptr(), num_kv_heads, num_blocks, block_size, head_dim,
            query.shape[1], block_table.data_ptr(), block_table.stride(0),
            items.ctypes.data, len(items), scale, sliding_window or 0,
            None if sinks is None else sinks.data_ptr(), softcap or 0.0,
            output.data_ptr(), output.stride(0), torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"paged attention kernel failed: {_ERRORS.get(status, status)}")


def amx_wanted() -> bool:
    """CONVEYOR_CPU_AMX: on unless set off; a value that is neither is refused."""
    return switch_from_env("CONVEYOR_CPU_AMX")


def kernel_disabled() -> bool:
    return native.compiled_paths_disabled()


def load_kernel(
    dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype | None = None
) -> PagedAttentionKernel | None:
    """The kernel for queries of ``dtype`` over a cache of ``kv_dtype`` (default: ``dtype``),
    built if needed; None (logged once) where it is disabled, has no build for those dtypes, or
    cannot be built. One object per build, whichever way it is asked for."""
    return _load_kernel(dtype, dtype if kv_dtype is None else kv_dtype)


@functools.cache
def _load_kernel(dtype: torch.dtype, kv_dtype: torch.dtype) -> PagedAttentionKernel | None:
    if (dtype, kv_dtype) not in BUILDS:
        return None
    if kernel_disabled():
        logger.info("CPU attention kernel disabled by CONVEYOR_CPU_KERNEL; using torch ops")
        return None
    amx_wanted()  # a bad CONVEYOR_CPU_AMX stops here, not as a failed build
    # Without a compiler the worker's start-up warning has said so, and what it costs.
    return native.load_optional(
        logger, "CPU attention kernel", "using torch ops", SOURCE_PATH, _inputs(),
        functools.partial(_from_library, dtype=dtype, kv_dtype=kv_dtype),
        BUILDS[dtype, kv_dtype], no_compiler_level=logging.INFO,
    )  # fmt: skip


# Tests rebuild under another environment.
load_kernel.cache_clear = _load_kernel.cache_clear  # type: ignore[attr-defined]


def load_kernel_from(
    folder: Path, dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype | None = None
) -> tuple[PagedAttentionKernel | None, list[str]]:
    """The kernel built from another copy of the sources (``folder`` holds its paged_attention.c
    and headers, e.g. an older commit's), for benchmarks that time two versions side by side;
    None and why each build failed where it does not build or load."""
    compiler = find_compiler()
    if compiler is None:
        return None, ["no C compiler (set CC)"]
    source = Path(folder) / SOURCE_PATH.name
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    return native.build_and_load(
        source,
        _inputs(source.parent),
        functools.partial(_from_library, dtype=dtype, kv_dtype=kv_dtype),
        compiler,
        BUILDS[dtype, kv_dtype],
    )


def _inputs(folder: Path = SOURCE_PATH.parent) -> list[Path]:
    """Every file a build of the kernel in ``folder`` reads (its hash keys the cached build)."""
    return [*sorted(folder.glob("*.[ch]")), native.SHARED_HEADERS / "amx_permission.h"]


def _build(
    compiler: str,
    flags: tuple[str, ...],
    dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype | None = None,
) -> Path:
    defines = BUILDS[dtype, dtype if kv_dtype is None else kv_dtype]
    return native.build(compiler, (*flags, *defines), SOURCE_PATH, _inputs())


def _load(
    path: Path, dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype | None = None
) -> PagedAttentionKernel:
    return _from_library(ctypes.CDLL(str(path)), path, dtype, kv_dtype)


def _from_library(
    library: ctypes.CDLL,
    path: Path,
    dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype | None = None,
) -> PagedAttentionKernel:
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    if library.conveyor_abi_version() != ABI_VERSION:
        raise RuntimeError(f"{path} has ABI {library.conveyor_abi_version()}, want {ABI_VERSION}")
    built = (library.conveyor_element_bytes(), library.conveyor_kv_element_bytes())
    wanted = tuple(torch.empty((), dtype=d).element_size() for d in (dtype, kv_dtype))
    if built != wanted:
        raise RuntimeError(f"{path} is not the build for {dtype} queries over a {kv_dtype} cache")
    return PagedAttentionKernel(library, path, dtype, kv_dtype)
