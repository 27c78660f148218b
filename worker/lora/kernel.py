"""The compiled grouped LoRA correction (``worker/layers/csrc/lora_sgmv.c``): every adapter of
a step in one call per adapted layer.

Runs in worker processes. Built and cached like the other CPU kernels (``worker.native``);
where it cannot be built, on a GPU, for float16, or with ``CONVEYOR_LORA_KERNEL=0`` (or
``CONVEYOR_CPU_KERNEL=0``), ``LoRASlots`` runs its torch loop instead, which is also the
reference the kernel is tested against.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import numpy as np
import torch

from conveyor.worker import native

logger = logging.getLogger(__name__)

SOURCE_PATH = Path(__file__).parent.parent / "layers" / "csrc" / "lora_sgmv.c"
ABI_VERSION = 1  # CONVEYOR_LORA_SGMV_ABI_VERSION in the source
# What the kernel takes, for the activations and the slots alike.
DTYPES = (torch.float32, torch.bfloat16)
# Off (0, false, no, off) keeps the torch loop: for comparison in benchmarks and as a way out.
KERNEL_ENV = "CONVEYOR_LORA_KERNEL"

_i32, _i64, _ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
_ADD_ARGTYPES = [
    _ptr, _i64, _ptr, _i64, _i32,  # x and its row stride, out and its row stride, bfloat16
    _ptr, _i64, _ptr, _i64,  # token rows (or NULL) and the offset, segments and their count
    _ptr, _ptr, _i32,  # A^T, B, bfloat16
    _ptr, _ptr, _i32, _i64,  # ranks [slots][parts], part columns, parts, max rank
    _i64, _i64, _i32,  # in and out features, threads
]  # fmt: skip


class LoRAKernel:
    """The loaded library."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._add = native.status_function(library, "conveyor_lora_add", _ADD_ARGTYPES)

    def add(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        token_rows: torch.Tensor | None,
        offset: int,
        segments: np.ndarray,
        a_t: torch.Tensor,
        b: torch.Tensor,
        ranks: torch.Tensor,
        part_cols: torch.Tensor,
    ) -> None:
        """``out`` += each segment's correction, in place. x [T, K] and out [T, N] with unit
        column stride, in one of ``DTYPES``; ``segments`` int64 [S, 3] (slot, start, end);
        a_t [slots, K, W] and b [slots, W, N] contiguous, in one dtype of ``DTYPES``."""
        status = self._add(
            x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0),
            out.dtype == torch.bfloat16,
            None if token_rows is None else token_rows.data_ptr(), offset,
            segments.ctypes.data, len(segments),
            a_t.data_ptr(), b.data_ptr(), a_t.dtype == torch.bfloat16,
            ranks.data_ptr(), part_cols.data_ptr(), ranks.shape[1], a_t.shape[2] // ranks.shape[1],
            a_t.shape[1], b.shape[2], torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"LoRA kernel failed with status {status}")


def _from_library(library: ctypes.CDLL, path: Path) -> LoRAKernel:
    version = library.conveyor_lora_sgmv_abi_version()
    if version != ABI_VERSION:
        raise RuntimeError(f"{path} has ABI {version}, want {ABI_VERSION}")
    return LoRAKernel(library, path)


def kernel_for(device: torch.device, dtype: torch.dtype) -> LoRAKernel | None:
    """The kernel for slots of ``dtype`` on ``device``, or None: the torch loop serves them."""
    if torch.device(device).type != "cpu" or dtype not in DTYPES or not kernel_enabled():
        return None
    return load_lora_kernel()


@functools.cache
def kernel_enabled() -> bool:
    """CONVEYOR_LORA_KERNEL (a value that is neither on nor off is refused at start-up)."""
    from conveyor.worker.kv_cache import switch_from_env  # kv_cache imports the layers

    return switch_from_env(KERNEL_ENV)


@functools.cache
def load_lora_kernel() -> LoRAKernel | None:
    """The library, built if needed; None (logged once) where it is off or cannot be built."""
    return native.load_optional(
        logger, "grouped LoRA kernel", "LoRA layers run a torch loop over the step's adapters",
        SOURCE_PATH, [SOURCE_PATH, native.SHARED_HEADERS / "panel_tiles.h"], _from_library,
    )  # fmt: skip
