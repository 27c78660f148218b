"""Host-memory tensors on transparent huge pages, for the CPU KV cache and the CPU weights.

Runs in worker processes. A decode reads every cached key and value of its request, block by
block, from wherever the block manager put them: with 4 KiB pages each block of one head is a
page of its own, so nearly every block costs a TLB miss and a page walk, and the hardware
prefetchers stop at every page boundary. Most Linux hosts run transparent huge pages in
``madvise`` mode (only regions that ask get them); asking for them made decodes read their cache
from memory 1.01-1.24x faster on the bench model (64 decodes at 128-1,024 cached tokens, the
longer the more). Where the kernel has no transparent huge pages, or the platform no
``madvise``, the mapping is plain anonymous memory, which behaves as ``torch.zeros`` does.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import sys

import torch

HUGE_PAGE_BYTES = 2 << 20


def zeros_on_huge_pages(
    shape: tuple[int, ...], dtype: torch.dtype, fault_in: bool = True
) -> torch.Tensor:
    """A zeroed CPU tensor in an anonymous mapping that asked for huge pages, faulted in now
    (``fault_in``; else page by page as it is first written).

    The tensor holds the mapping (``torch.frombuffer`` keeps it referenced): it is unmapped when
    the last view of it goes. Touching every page here makes the kernel back the region with huge
    pages while it is fresh, and keeps the first steps of serving free of page faults."""
    element_size = torch.empty((), dtype=dtype).element_size()
    num_bytes = math.prod(shape) * element_size
    if num_bytes == 0 or not hasattr(mmap, "MADV_HUGEPAGE") or not sys.platform.startswith("linux"):
        return torch.zeros(shape, dtype=dtype)
    # A huge page needs a 2 MiB-aligned range: map one page more and start at the first boundary.
    # Private: a shared anonymous mapping is shmem, whose huge pages a separate knob governs.
    mapping = mmap.mmap(
        -1, num_bytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    )
    # Without transparent huge pages in this kernel: ordinary pages, the same contents.
    with contextlib.suppress(OSError):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    tensor = raw[offset : offset + num_bytes].view(dtype).view(shape)
    if fault_in:  # a fresh anonymous mapping reads as zeros either way
        tensor.zero_()
    return tensor


def place_weights_on_huge_pages(model: torch.nn.Module, min_bytes: int = HUGE_PAGE_BYTES) -> int:
    """Move a CPU model's parameters, buffers and compiled-kernel weight copies (a module's
    attributes with a ``weight_tensors()`` method: the 4-bit panels, int8 weights) into one
    mapping that asked for huge pages; returns the bytes moved.

    A decode step at a few rows streams every weight once, linear after linear: with 4 KiB
    pages every page of a weight is a TLB miss and the prefetchers stop at each page boundary,
    which a core streaming at a few GB/s feels (Qwen3-0.6B in 4 bits: the decoder's linears
    1.16-1.2x faster from huge pages, one and two threads, docs/performance.md). Tensors that
    share memory (a tied embedding and LM head) keep sharing it; oneDNN's packed copies are
    opaque and stay where they are. Each tensor is copied in and its old memory released in
    turn, so the peak is the model plus one tensor, not twice the model. Weights of fewer than
    ``min_bytes`` stay where they are (they fit in the caches; a huge page would mostly idle)."""
    slots: list[tuple[object, str, torch.Tensor] | None] = []
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            slots.append((module, name, param))
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None:
                slots.append((module, name, buffer))
        for value in vars(module).values():
            holder = getattr(value, "weight_tensors", None)
            if callable(holder) and not isinstance(value, torch.nn.Module):
                slots.extend(holder())
    unique: dict[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype], int] = {}
    offsets: list[int | None] = []
    total = 0
    for slot in slots:
        tensor = slot[2]
        if tensor.device.type != "cpu" or tensor.is_mkldnn or not tensor.is_contiguous():
            offsets.append(None)
            continue
        key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        if key not in unique:
            unique[key] = total
            total += -(-tensor.numel() * tensor.element_size() // 64) * 64
        offsets.append(unique[key])
    tensor = None  # the loop must not keep the last one alive
    if total < min_bytes:
        return 0
    # Not faulted in here: each page arrives with the first copy into it, while the tensors
    # copied before it have already let their memory go.
    arena = zeros_on_huge_pages((total,), torch.uint8, fault_in=False)
    placed: dict[int, torch.Tensor] = {}
    for index, offset in enumerate(offsets):
        owner, name, tensor = slots[index]
        slots[index] = None  # this list must not keep the old memory alive
        if offset is None:
            continue
        view = placed.get(offset)
        if view is None:
            nbytes = tensor.numel() * tensor.element_size()
            view = arena[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor)
            placed[offset] = view
        if isinstance(tensor, torch.nn.Parameter):
            tensor.data = view
        else:
            setattr(owner, name, view)
    return total
