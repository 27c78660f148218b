"""One adapted linear layer's LoRA slots, and the step's tokens grouped by slot.

Runs in worker processes. Every adapted layer holds, for each of ``max_loras`` slots, an A of
``[parts * max_rank, in]`` and a B, stored transposed, of ``[parts * max_rank, out]`` (zero where
an adapter's rank is smaller or it does not target a part): a fused layer (q/k/v, gate/up) stacks
its parts' A rows and puts each part's B in its own output columns and rank rows, so one shrink
and one expand per slot serve all its parts. The scale (alpha / r, or alpha / sqrt(r) for rsLoRA)
is folded into B when it is loaded. B is kept transposed because the expand of a few rows
against a transposed view of ``[out, rank]`` runs 20-70x slower on CPU than against a contiguous
``[rank, out]`` (MKL, 4 rows x rank 32 x 3,072 outputs: 666 against 10 us).

The base linear runs once over the whole step; ``add_to`` then adds ``x A^T B^T`` to the rows of
each slot in the step (a loop over the step's adapters, never over requests). ``StepGroups``
sorts the step's tokens by slot once per step; every layer reuses it. The model runner orders
the step's requests by slot first (``LoRAManager.begin_step``), so the runs are slices of the
flat stream and no layer gathers or scatters; tokens in any other order still work, gathered
into slot order and added back.

Tensor parallelism shards the slots like the layer: a column-parallel layer keeps the whole A
and this rank's output rows of B (sliced by the layer's own weight loader); a row-parallel layer
keeps this rank's input columns of A and the whole B, and the layer's all-reduce sums the
ranks' partial corrections with its partial products.
"""

from __future__ import annotations

import numpy as np
import torch

from conveyor.worker.layers.linear import LinearBase, RowParallelLinear, ShardId


class StepGroups:
    """The step's LoRA tokens sorted by slot: contiguous runs ``(slot, start, end)``.

    ``perm`` maps a run's rows back to the flat stream (None when the LoRA tokens already lie in
    slot order in one contiguous range, then ``offset`` places the runs and no gather is needed).
    """

    def __init__(self) -> None:
        self.segments: list[tuple[int, int, int]] = []
        self.perm: torch.Tensor | None = None
        self.offset = 0
        self.num_tokens = 0

    def set_tokens(self, token_slots: np.ndarray, device: torch.device) -> None:
        """``token_slots[t]``: the slot of token t of the flat stream, -1 for the base model."""
        self.num_tokens = len(token_slots)
        lora_tokens = np.flatnonzero(token_slots >= 0)
        self.perm, self.offset = None, 0
        if len(lora_tokens) == 0:
            self.segments = []
            return
        order = lora_tokens[np.argsort(token_slots[lora_tokens], kind="stable")]
        slots = token_slots[order]
        cuts = (np.flatnonzero(np.diff(slots)) + 1).tolist()
        starts, ends = [0, *cuts], [*cuts, len(order)]
        segments = [(int(slots[s]), s, e) for s, e in zip(starts, ends)]
        if order[-1] - order[0] == len(order) - 1 and np.all(np.diff(order) == 1):
            self.offset = int(order[0])
        else:
            self.perm = torch.from_numpy(order.astype(np.int64)).to(device)
        self.segments = segments

    def clear(self) -> None:
        self.segments = []
        self.perm = None


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
        self.a = torch.zeros(max_loras, width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, width, out_features, dtype=dtype, device=device)

    def load(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Fill ``slot`` with (A, scaled B) per part (full checkpoint shapes); the rest zero."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for part, (a, b) in parts.items():
            rank = a.shape[0]
            cols = slice(part * self.max_rank, part * self.max_rank + rank)
            a, b = a.to(self.a.dtype), b.to(self.b.dtype)
            if self.row_parallel:
                self.layer.weight_loader(self.a[slot, cols], a)  # this rank's input columns
                self.b[slot, cols].copy_(b.t())
            else:
                self.a[slot, cols].copy_(a)
                # Through B's transposed view: the layer's loader slices output rows.
                self.layer.weight_loader(self.b[slot, cols].t(), b, self._shard_id(part))

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def _shard_id(self, part: int) -> ShardId:
        if self.num_parts == 3:
            return "qkv"[part]
        if self.num_parts == 2:
            return part
        return None

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (the base layer's output for input ``x``) plus each token's correction."""
        groups = self.groups
        if not groups.segments:
            return out
        if x.shape[0] != groups.num_tokens:
            raise RuntimeError(
                f"LoRA layer got {x.shape[0]} rows for a step of {groups.num_tokens} tokens"
            )
        a, b = self.a, self.b
        if groups.perm is None and out.dtype == a.dtype:
            offset = groups.offset
            for slot, start, end in groups.segments:
                rows = slice(offset + start, offset + end)
                shrunk = torch.mm(x[rows].to(a.dtype), a[slot].t())
                out[rows].addmm_(shrunk, b[slot])
            return out
        gathered = x.index_select(0, groups.perm) if groups.perm is not None else x
        delta = torch.empty(
            gathered.shape[0] if groups.perm is not None else x.shape[0],
            out.shape[1],
            dtype=a.dtype,
            device=out.device,
        )
        if groups.perm is None:  # contiguous, in another dtype than the layer's output
            offset = groups.offset
            delta.zero_()
            for slot, start, end in groups.segments:
                rows = slice(offset + start, offset + end)
                shrunk = torch.mm(gathered[rows].to(a.dtype), a[slot].t())
                torch.mm(shrunk, b[slot], out=delta[rows])
            return out.add_(delta.to(out.dtype))
        for slot, start, end in groups.segments:
            shrunk = torch.mm(gathered[start:end].to(a.dtype), a[slot].t())
            torch.mm(shrunk, b[slot], out=delta[start:end])
        return out.index_add_(0, groups.perm, delta.to(out.dtype))
