"""Pick the attention backend for a device, block size and dtype.

Runs in worker processes. flash-attn is chosen automatically where it can run (CUDA, flash_attn
importable, block_size a multiple of 256, float16/bfloat16, no attention sinks); on CUDA where it
cannot, the Triton kernel (any block size and dtype, sinks too), said at INFO with the reason;
everywhere else the torch backend, which on CPU runs every query through the compiled kernel where
it builds. Falling back to torch ops on CUDA is a WARNING saying why. An explicit choice
(``--attention-backend``) that cannot run is an error naming the reason, never a silent
fallback.
"""

from __future__ import annotations

import logging

import torch

from conveyor.worker.attention.backend import AttentionBackend
from conveyor.worker.attention.cpu_kernel import BUILDS as KERNEL_BUILDS
from conveyor.worker.attention.cpu_kernel import kernel_disabled, load_kernel
from conveyor.worker.attention.flash_attn_backend import (
    FLASH_BLOCK_SIZE_MULTIPLE,
    FLASH_DTYPES,
    FlashAttnBackend,
    flash_attn_import_error,
)
from conveyor.worker.attention.torch_backend import TorchAttentionBackend
from conveyor.worker.attention.triton_backend import TritonAttentionBackend, triton_unusable_reason

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("torch", "flash-attn", "triton", "cpu-kernel")


def select_backend(
    device: torch.device,
    block_size: int,
    override: str | None = None,
    dtype: torch.dtype | None = None,
    needs_sinks: bool = False,
    kv_dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """The backend to use; ``override`` forces one, None/"auto" picks.

    "torch": torch ops only; "cpu-kernel": the torch backend with the compiled CPU kernel, which
    must build; "flash-attn": flash-attn 2. ``dtype`` is the model's activation dtype; None means
    "not known yet" and does not rule flash-attn out. ``needs_sinks``: the model has attention
    sinks (gpt-oss), which flash-attn 2 does not compute. ``kv_dtype``: the cache's, when it is
    not the model's (``--kv-cache-dtype``, CPU only).
    """
    if override not in (None, "auto", *BACKEND_NAMES):
        raise ValueError(
            f"unknown attention backend {override!r}; choose one of auto, {', '.join(BACKEND_NAMES)}"
        )
    if override == "torch":
        logger.info("attention backend: torch ops (requested)")
        return TorchAttentionBackend(use_cpu_kernel=False)
    if override == "cpu-kernel":
        return _cpu_kernel_backend(device, dtype or torch.float32, kv_dtype)
    if override == "triton":
        triton_reason = triton_unusable_reason(device)
        if triton_reason is not None:
            raise ValueError(f"attention backend 'triton' cannot run here: {triton_reason}")
        logger.info("attention backend: triton (requested)")
        return TritonAttentionBackend()
    if needs_sinks:
        reason: str | None = "the model has attention sinks, which flash-attn 2 does not compute"
    else:
        reason = flash_attn_unusable_reason(device, block_size, dtype)
    if override == "flash-attn":
        if reason is not None:
            raise ValueError(f"attention backend 'flash-attn' cannot run here: {reason}")
        logger.info("attention backend: flash-attn (requested)")
        return FlashAttnBackend()
    if reason is None:
        logger.info(
            "attention backend: flash-attn (CUDA, flash_attn imports, block_size %d)", block_size
        )
        return FlashAttnBackend()
    if device.type == "cuda":
        triton_reason = triton_unusable_reason(device)
        if triton_reason is None:
            logger.info(
                "attention backend: triton (flash-attn cannot run: %s; with flash-attn installed "
                "and --block-size unset it would, docs/serving.md#cuda)",
                reason,
            )
            return TritonAttentionBackend()
        # The torch path on a GPU is correct but several times slower: say why and what to do.
        logger.warning(
            "attention backend: torch ops on CUDA, because flash-attn cannot run: %s, and "
            "triton cannot either: %s. For the fast path install flash-attn "
            "(docs/serving.md#cuda) and leave --block-size unset (it then defaults to 256), or "
            "pass --attention-backend torch to silence this",
            reason,
            triton_reason,
        )
    else:
        logger.info("attention backend: torch (flash-attn not used: %s)", reason)
    return TorchAttentionBackend()


def _cpu_kernel_backend(
    device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
) -> TorchAttentionBackend:
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    if device.type != "cpu":
        raise ValueError(f"attention backend 'cpu-kernel' runs on CPU only, this is {device.type}")
    if kernel_disabled():
        raise ValueError("attention backend 'cpu-kernel' requested but CONVEYOR_CPU_KERNEL=0")
    if (dtype, kv_dtype) not in KERNEL_BUILDS:
        raise ValueError(
            "attention backend 'cpu-kernel' runs float32 and bfloat16 models (a float32 one "
            f"also over a bfloat16 cache), not {dtype} over a {kv_dtype} cache"
        )
    if load_kernel(dtype, kv_dtype) is None:
        raise ValueError(
            "attention backend 'cpu-kernel' cannot run here: the kernel did not build (the "
            "log above says why; it needs a C compiler with OpenMP, e.g. gcc)"
        )
    logger.info("attention backend: torch with the compiled CPU kernel (requested)")
    return TorchAttentionBackend(use_cpu_kernel=True)


def flash_attn_unusable_reason(
    device: torch.device, block_size: int, dtype: torch.dtype | None
) -> str | None:
    """Why flash-attn cannot run with these settings, or None when it can."""
    if device.type != "cuda":
        return f"it needs a CUDA device, this is {device.type}"
    if block_size % FLASH_BLOCK_SIZE_MULTIPLE:
        return (
            f"its paged KV cache needs block_size a multiple of {FLASH_BLOCK_SIZE_MULTIPLE}, "
            f"got {block_size}"
        )
    if dtype is not None and dtype not in FLASH_DTYPES:
        return f"it supports float16 and bfloat16 only, got {dtype}"
    import_error = flash_attn_import_error()
    if import_error is not None:
        return f"flash_attn does not import ({import_error})"
    return None
