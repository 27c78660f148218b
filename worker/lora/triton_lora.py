"""The LoRA correction of one adapted layer on CUDA: every adapter of the step in two Triton
launches (a "shrink" and an "expand", Punica's batched gather-matvec written for our slots).

Runs in worker processes. Each token carries its slot (``token_slots``, -1 for the base model)
on the device, so one launch serves the whole step whatever adapters it mixes, with no host sync
and no shapes that depend on the step's adapters: the launches can sit in a CUDA graph. A
program takes one token (and, in the expand, one block of outputs) and reads its slot's A or B:

- shrink: ``shrunk[t] = x[t] A_t[slot]`` over the slot's full width (parts x max_rank; the rank
  columns an adapter does not use are zero), summed in float32 and kept in float32;
- expand: ``out[t, n] += shrunk[t] B[slot][:, n]``, summed in float32, rounded once to ``out``'s
  dtype.

A token reads its slot's weights alone, so a step of many adapters reads each adapter's weights
once per token of it: what a decode step (one token a request) wants; a long LoRA prompt reads
them once per token too (the CPU's grouped kernel tiles rows instead). The layer keeps its torch
loop where Triton is missing or ``CONVEYOR_LORA_KERNEL=0``, and after a launch that raised.

Under a CUDA graph every adapted layer launches both kernels on the graph's padded row count,
whatever the step's adapters (a replay runs no Python to skip them), reading the slots from the
persistent buffer ``StepGroups.slot_buffer``; padding rows and base-model rows hold -1 there and
get nothing added. ``shrunk`` is allocated inside ``add``: under capture that allocation comes
from the graph's private memory pool, so every replay finds it at the same address, and the
memory is counted with the graph's; nothing here reads a device value on the host.
The CPU tests run these kernels in Triton's interpreter against the loop
(tests/worker/test_lora_triton.py); scripts/compile_triton_sm90.py compiles them for sm_90.
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

# Input features a shrink program sums per step, and outputs an expand program writes.
BLOCK_K = 64
BLOCK_N = 64

# Why the kernels stopped being used in this process (a launch raised); None while they work.
failure: str | None = None


@functools.cache
def _kernels():
    from conveyor.worker.lora import triton_lora_kernels

    return triton_lora_kernels


def triton_lora_enabled() -> bool:
    """Whether CUDA LoRA layers take these kernels: Triton imports, CONVEYOR_LORA_KERNEL does
    not turn the LoRA kernels off, and no launch has raised."""
    return unavailable_reason() is None


def unavailable_reason() -> str | None:
    """Why CUDA LoRA layers cannot take these kernels (None: they can), for the log."""
    from conveyor.worker.attention.triton_backend import triton_import_error
    from conveyor.worker.lora.kernel import KERNEL_ENV, kernel_enabled

    if failure is not None:
        return f"a launch failed ({failure})"
    if not kernel_enabled():
        return f"{KERNEL_ENV} turns the LoRA kernels off"
    import_error = triton_import_error()
    if import_error is not None:
        return f"triton does not import ({import_error})"
    return None


def width_block(width: int) -> int:
    """The slots' width rounded up to a power of two (a Triton block's length)."""
    return max(16, 1 << (width - 1).bit_length())


def add(
    x: torch.Tensor,
    out: torch.Tensor,
    token_slots: torch.Tensor,
    a_t: torch.Tensor,
    b: torch.Tensor,
) -> bool:
    """``out[t] += x[t] A_t[slot] B[slot]`` for every token t whose slot is not -1, in place.

    x [T, in] and out [T, out] with unit column stride; token_slots int32 [T] on their device;
    a_t [slots, in, W] and b [slots, W, out] dense. False (logged once, the loop from then on)
    if a launch raised.
    """
    global failure
    num_tokens, in_features = x.shape
    width, out_features = b.shape[1], b.shape[2]
    if num_tokens == 0:
        return True
    kernels = _kernels()
    shrunk = torch.empty(num_tokens, width, dtype=torch.float32, device=x.device)
    try:
        kernels.shrink[(num_tokens,)](
            x, a_t, token_slots, shrunk,
            x.stride(0), a_t.stride(0), a_t.stride(1), shrunk.stride(0), in_features, width,
            BLOCK_K=BLOCK_K, BLOCK_W=width_block(width),
        )  # fmt: skip
        grid = (num_tokens, -(-out_features // BLOCK_N))
        kernels.expand[grid](
            shrunk, b, token_slots, out,
            shrunk.stride(0), b.stride(0), b.stride(1), out.stride(0), out_features, width,
            BLOCK_W=width_block(width), BLOCK_N=BLOCK_N,
        )  # fmt: skip
    except Exception as error:  # a Triton that cannot compile them: the loop serves
        failure = f"{type(error).__name__}: {error}"
        logger.warning("the Triton LoRA kernels failed (%s); using the torch loop", failure)
        return False
    return True
