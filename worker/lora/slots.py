"""One adapted linear layer's LoRA slots, and how they add each token's correction.

Runs in worker processes. Every adapted layer holds, for each of ``max_loras`` slots, A stored
transposed, ``[in, parts * max_rank]``, and B stored transposed, ``[parts * max_rank, out]``
(zero where an adapter's rank is smaller or it does not target a part): a fused layer (q/k/v,
gate/up) puts each part's A in its own rank columns and each part's B in its own rank rows and
output columns, and ``ranks`` says how many rank rows of each part a slot uses. The scale
(alpha / r, or alpha / sqrt(r) for rsLoRA) is folded into B when it is loaded. Both are kept
contiguous along the rank and output dimensions because the products of a few rows against
transposed views ran 20-70x slower on CPU (MKL, 4 rows x rank 32 x 3,072 outputs: 666 against
10 us), and the grouped kernel reads them row by row.

The base linear runs once over the whole step; ``add_to`` then adds ``x A^T B^T`` to the rows of
each slot in the step: on CPU in one call of the grouped kernel (worker/lora/kernel.py) for all
the step's adapters, on CUDA in two Triton launches (worker/lora/triton_lora.py), elsewhere (or
where neither can run) a torch loop over the step's adapters, never over requests. While the
runner captures CUDA graphs, every call takes the Triton launches on all its rows
(``add_for_graph``), since a replayed graph cannot skip a layer for a step without adapters.
``StepGroups`` (step_groups.py) sorts the step's tokens by slot once per step; every layer
reuses it. The model runner orders the step's requests by slot first
(``LoRAManager.begin_step``), so the runs are slices of the flat stream and no layer gathers or
scatters; tokens in any other order still work (the kernel reads and writes them in place, the
loop gathers them into slot order and adds them back).

Tensor parallelism shards the slots like the layer: a column-parallel layer keeps the whole A
and this rank's output rows of B (sliced by the layer's own weight loader); a row-parallel layer
keeps this rank's input columns of A and the whole B, and the layer's all-reduce sums the
ranks' partial corrections with its partial products.
"""

from __future__ import annotations

import numpy as np
import torch

from conveyor.worker.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    ShardId,
)
from conveyor.worker.lora import triton_lora
from conveyor.worker.lora.kernel import DTYPES, LoRAKernel, kernel_for
from conveyor.worker.lora.step_groups import StepGroups


class LoRASlots:
    """The LoRA weights of one linear layer, one slot per adapter a step may use."""

    def __init__(
        self,
        layer: LinearBase,
        num_parts: int,
        groups: StepGroups,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        out_features, in_features = layer.weight.shape
        self.layer = layer
        self.num_parts = num_parts
        self.max_rank = max_rank
        self.groups = groups
        self.row_parallel = isinstance(layer, RowParallelLinear)
        width = num_parts * max_rank
        self.a_t = torch.zeros(max_loras, in_features, width, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, width, out_features, dtype=dtype, device=device)
        # The rank rows of each part a slot uses (0: the part is not adapted), and each part's
        # first output column on this rank: the kernel touches nothing else.
        self.ranks = torch.zeros(max_loras, num_parts, dtype=torch.int32)
        self.part_cols = torch.tensor(_part_columns(layer, num_parts), dtype=torch.int64)
        if self.part_cols[-1] != out_features:
            raise ValueError(f"LoRA parts end at {self.part_cols[-1]}, not at {out_features}")
        self.kernel: LoRAKernel | None = kernel_for(device, dtype)

    def load(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Fill ``slot`` with (A, scaled B) per part (full checkpoint shapes); the rest zero."""
        self.clear(slot)
        for part, (a, b) in parts.items():
            rank = a.shape[0]
            cols = slice(part * self.max_rank, part * self.max_rank + rank)
            # Recorded first, so a failed copy is still cleared by the next load.
            self.ranks[slot, part] = rank
            a, b = a.to(self.a_t.dtype), b.to(self.b.dtype)
            if self.row_parallel:  # through A's transposed view: the loader slices columns
                self.layer.weight_loader(self.a_t[slot, :, cols].t(), a)
                self.b[slot, cols].copy_(b.t())
            else:
                self.a_t[slot, :, cols].copy_(a.t())
                # Through B's transposed view: the layer's loader slices output rows.
                self.layer.weight_loader(self.b[slot, cols].t(), b, self._shard_id(part))

    def clear(self, slot: int) -> None:
        """Zero what the slot's adapter wrote (``ranks`` says where); the rest is zero already,
        so a swap does not rewrite the whole slot."""
        for part, rank in enumerate(self.ranks[slot].tolist()):
            if rank:
                cols = slice(part * self.max_rank, part * self.max_rank + rank)
                self.a_t[slot, :, cols].zero_()
                self.b[slot, cols].zero_()
        self.ranks[slot].zero_()

    def _shard_id(self, part: int) -> ShardId:
        if self.num_parts == 3:
            return "qkv"[part]
        if self.num_parts == 2:
            return part
        return None

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (the base layer's output for input ``x``) plus each token's correction."""
        groups = self.groups
        if groups.capturing:
            return self.add_for_graph(x, out)
        if not groups.segments:
            return out
        if x.shape[0] != groups.num_tokens:
            raise RuntimeError(
                f"LoRA layer got {x.shape[0]} rows for a step of {groups.num_tokens} tokens"
            )
        if self.kernel is not None and _kernel_takes(x, out):
            self.kernel.add(
                x, out, groups.perm, groups.offset, groups.segment_array,
                self.a_t, self.b, self.ranks, self.part_cols,
            )  # fmt: skip
            return out
        if (
            groups.token_slots is not None
            and x.is_cuda
            and x.stride(1) == 1
            and out.stride(1) == 1
            and triton_lora.triton_lora_enabled()
            and triton_lora.add(x, out, groups.token_slots, self.a_t, self.b)
        ):
            return out
        return self.add_with_torch(x, out)

    def add_for_graph(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``add_to`` as a CUDA graph records it: both Triton launches over all of ``x``'s rows
        (a padded decode step's), each reading its slot from the slot buffer, whatever the
        step being captured holds; launches and shapes depend on the row count alone, and
        nothing waits on the device. Refused where the kernels cannot run: a graph without
        them would replay the base model for every token (the runner then runs eagerly)."""
        buffer = self.groups.slot_buffer
        reason = triton_lora.unavailable_reason()
        if buffer is None or reason is not None:
            raise RuntimeError(
                "LoRA under CUDA graphs needs the Triton LoRA kernels and the slot buffer: "
                + (reason or "this step's groups have no slot buffer")
            )
        num_rows = x.shape[0]
        if num_rows > len(buffer.device_tensor):
            raise RuntimeError(
                f"a graph of {num_rows} rows over the LoRA slot buffer's "
                f"{len(buffer.device_tensor)}"
            )
        slots = buffer.device_tensor[:num_rows]
        if not triton_lora.add(x, out, slots, self.a_t, self.b):
            raise RuntimeError(f"the Triton LoRA kernels failed ({triton_lora.failure})")
        return out

    def add_with_torch(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``add_to`` as two matmuls per adapter in the step (the kernel's reference)."""
        groups = self.groups
        a_t, b = self.a_t, self.b
        if groups.perm is None and out.dtype == a_t.dtype:
            offset = groups.offset
            for slot, start, end in groups.segments:
                rows = slice(offset + start, offset + end)
                shrunk = torch.mm(x[rows].to(a_t.dtype), a_t[slot])
                out[rows].addmm_(shrunk, b[slot])
            return out
        gathered = x.index_select(0, groups.perm) if groups.perm is not None else x
        delta = torch.empty(
            gathered.shape[0] if groups.perm is not None else x.shape[0],
            out.shape[1],
            dtype=a_t.dtype,
            device=out.device,
        )
        if groups.perm is None:  # contiguous, in another dtype than the layer's output
            offset = groups.offset
            delta.zero_()
            for slot, start, end in groups.segments:
                rows = slice(offset + start, offset + end)
                shrunk = torch.mm(gathered[rows].to(a_t.dtype), a_t[slot])
                torch.mm(shrunk, b[slot], out=delta[rows])
            return out.add_(delta.to(out.dtype))
        for slot, start, end in groups.segments:
            shrunk = torch.mm(gathered[start:end].to(a_t.dtype), a_t[slot])
            torch.mm(shrunk, b[slot], out=delta[start:end])
        return out.index_add_(0, groups.perm, delta.to(out.dtype))


def _kernel_takes(x: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the grouped kernel reads ``x`` and writes ``out`` as they are: CPU rows of unit
    column stride in one of its dtypes (the layers' inputs and outputs always are)."""
    return (
        x.dim() == 2
        and out.dim() == 2
        and x.dtype == out.dtype
        and x.dtype in DTYPES
        and x.is_cpu
        and x.stride(1) == 1
        and out.stride(1) == 1
    )


def _part_columns(layer: LinearBase, num_parts: int) -> list[int]:
    """Where each fused part's output columns start on this rank, then the end."""
    if isinstance(layer, QKVParallelLinear) and num_parts == 3:
        q, kv = layer.q_size, layer.kv_size
        return [0, q, q + kv, q + 2 * kv]
    if isinstance(layer, MergedColumnParallelLinear) and num_parts == len(layer.output_sizes):
        sizes = [size // layer.tp_size for size in layer.output_sizes]
        return [0, *np.cumsum(sizes).tolist()]
    if num_parts != 1:
        raise ValueError(f"{type(layer).__name__} has no {num_parts} LoRA parts")
    return [0, layer.weight.shape[0]]
