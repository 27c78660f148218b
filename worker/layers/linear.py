"""Linear layers written so tensor parallelism can shard them (Megatron style).

Runs in worker processes. A column-parallel layer splits its output features across ranks (each
rank computes a slice of the output, no communication); a row-parallel layer splits its input
features (each rank computes a partial sum, then an all-reduce). Every parameter carries a
``weight_loader(param, loaded_weight, shard_id=None)`` that copies this rank's slice of a
full checkpoint tensor, so the same loading code serves one rank or many, and fused layers
(q/k/v, gate/up) fill their parts from the separate tensors a Hugging Face checkpoint holds, or
from one already-fused tensor (Phi-3), split into its parts first.
Once every weight is in, ``process_weights_after_loading`` packs a copy for the CPU's small-batch
kernel (see gemm.py); the plain weight stays what the loader and the tests see. With
``--quantization int8`` the loader then turns the column- and row-parallel weights into int8
(``quantize_int8``, see int8_linear.py); the float weight's memory is released. A quantized
checkpoint's layers hold a ``QuantizedWeights`` child instead of the float weight
(``use_quantized_weights``, before loading; see worker/layers/quantization/).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from conveyor.worker.layers.gemm import linear, pack_weight
from conveyor.worker.layers.int8_linear import Int8Weight
from conveyor.worker.layers.parallel import all_reduce, divide
from conveyor.worker.layers.quantization.scheme import LinearScheme
from conveyor.worker.layers.quantization.weights import QuantizedWeights

# Which part of a fused parameter a checkpoint tensor fills: "q"/"k"/"v", or 0/1 for gate/up.
ShardId = str | int | None


def _set_weight_loader(param: nn.Parameter, loader: object) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


def default_weight_loader(
    param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
) -> None:
    """Copy a whole tensor (replicated parameters: norms, unsharded biases)."""
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)}, checkpoint "
            f"{tuple(loaded_weight.shape)}"
        )
    param.data.copy_(loaded_weight)


def _split_rows(loaded_weight: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    """A fused checkpoint tensor -> its parts, at the full model's sizes (before any sharding).

    Each part then goes through the per-part path, which takes this rank's slice of it: a rank
    holds a slice of every part, not one contiguous slice of the fused tensor.
    """
    if loaded_weight.shape[0] != sum(sizes):
        raise ValueError(
            f"fused checkpoint tensor has {loaded_weight.shape[0]} rows, expected {sum(sizes)} "
            f"(parts {sizes})"
        )
    return loaded_weight.split(sizes, dim=0)


class LinearBase(nn.Module):
    """y = x W^T (+ b) with W of shape [output_size, input_size] on this rank."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool, tp_rank: int, tp_size: int
    ) -> None:
        super().__init__()
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        _set_weight_loader(self.weight, self._load)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            _set_weight_loader(self.bias, self._load)
        else:
            self.register_parameter("bias", None)
        # Not a parameter or buffer: a derived copy, rebuilt after loading, never saved.
        self.packed_weight: torch.Tensor | None = None
        # The weight in int8 once ``quantize_int8`` ran; the float weight is then a meta tensor.
        self.int8: Int8Weight | None = None
        # LoRA slots (worker/lora/) when adapters are served: their correction is added to the
        # output. A plain attribute, not a submodule: its tensors are no checkpoint's.
        self.lora: Any = None
        # A quantized checkpoint's weights, when ``use_quantized_weights`` ran.
        self.quant: QuantizedWeights | None = None

    def process_weights_after_loading(self) -> None:
        if self.quant is not None:
            self.quant.process_weights_after_loading()
        elif self.int8 is None:
            self.packed_weight = pack_weight(self.weight)

    def use_quantized_weights(self, scheme: LinearScheme) -> None:
        """Load a quantized checkpoint's tensors for this layer instead of a float weight (the
        float weight's shape stays, on the meta device, for code that reads it)."""
        out_features, in_features = self.weight.shape
        w = scheme.weights
        if isinstance(self, RowParallelLinear) and self.tp_size > 1:
            if w.act_order:
                raise ValueError("act-order (desc_act) weights with tensor parallelism")
            if w.group_size and in_features % w.group_size:
                raise ValueError(
                    f"{in_features} input features per rank are not whole groups of "
                    f"{w.group_size}; use a tensor-parallel size that divides the groups"
                )
        self.quant = QuantizedWeights(
            scheme, out_features, in_features, self.checkpoint_rows, self._load_quantized
        )
        del self._parameters["weight"]
        self.weight = torch.empty(out_features, in_features, device="meta")

    def checkpoint_rows(self, shard_id: ShardId) -> int:
        """How many output rows the checkpoint's tensor for a part has, all ranks together."""
        return self.weight.shape[0] * (1 if isinstance(self, RowParallelLinear) else self.tp_size)

    def _load_quantized(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        split_inputs = isinstance(self, RowParallelLinear) and self.tp_size > 1
        if split_inputs and loaded_weight.shape[1] == 1 and param.shape[1] == 1:
            default_weight_loader(param, loaded_weight)  # one scale per row: not split
            return
        self.weight_loader(param, loaded_weight, shard_id)

    def quantize_int8(self) -> None:
        """Compute with an int8 copy of the weight from now on and release the float one (its
        shape stays, on the meta device, for code that reads it). A second call does nothing."""
        if self.int8 is not None:
            return
        self.int8 = Int8Weight(self.weight, self.bias)
        self.packed_weight = None
        shape, dtype = self.weight.shape, self.weight.dtype
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), False)
        _set_weight_loader(self.weight, self._load)

    def _load(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        if self.int8 is not None:
            raise ValueError("an int8-quantized linear cannot load new weights; reload the model")
        self.packed_weight = None  # stale once the weight changes; rebuilt after loading
        self.weight_loader(param, loaded_weight, shard_id)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x, self.bias)
        return out if self.lora is None else self.lora.add_to(x, out)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T, plus ``bias`` when it is given (this layer's own bias or None)."""
        if self.quant is not None:
            return self.quant.linear(x, bias)
        if self.int8 is not None:
            # The int8 copy holds this layer's bias (padded, float32): only whether, not which.
            assert bias is None or bias is self.bias
            return self.int8.linear(x, with_bias=bias is not None)
        return linear(x, self.weight, bias, self.packed_weight)


class ReplicatedLinear(LinearBase):
    """The whole matrix on every rank: layers too small to be worth a collective (MoE routers)."""

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        default_weight_loader(param, loaded_weight)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks: rank r holds rows [r*n, (r+1)*n) of W."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__(input_size, divide(output_size, tp_size), bias, tp_rank, tp_size)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        size = param.shape[0]
        default_weight_loader(param, loaded_weight.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers on the same input in one matmul (gate and up projections).

    Each rank holds its slice of every part, parts side by side: [gate_r; up_r].
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, tp_rank, tp_size)

    def checkpoint_rows(self, shard_id: ShardId) -> int:
        return sum(self.output_sizes) if shard_id is None else self.output_sizes[shard_id]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        if shard_id is None:  # a checkpoint that already fuses the parts (Phi-3's gate_up_proj)
            for part_id, part in enumerate(_split_rows(loaded_weight, self.output_sizes)):
                self.weight_loader(param, part, part_id)
            return
        size = divide(self.output_sizes[shard_id], self.tp_size)
        offset = divide(sum(self.output_sizes[:shard_id]), self.tp_size)
        part = loaded_weight.narrow(0, self.tp_rank * size, size)
        default_weight_loader(param.narrow(0, offset, size), part)  # type: ignore[arg-type]


class QKVParallelLinear(ColumnParallelLinear):
    """The query, key and value projections fused: output [q | k | v] for this rank's heads.

    With more ranks than KV heads, each KV head is replicated on tp_size // num_kv_heads ranks.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.num_heads = divide(num_heads, tp_size)
        if tp_size >= num_kv_heads:
            self.num_kv_heads = 1
            self.kv_head_replicas = divide(tp_size, num_kv_heads)
        else:
            self.num_kv_heads = divide(num_kv_heads, tp_size)
            self.kv_head_replicas = 1
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        output_size = (self.q_size + 2 * self.kv_size) * tp_size
        super().__init__(hidden_size, output_size, bias, tp_rank, tp_size)

    def checkpoint_rows(self, shard_id: ShardId) -> int:
        q_rows = self.total_num_heads * self.head_dim
        kv_rows = self.total_num_kv_heads * self.head_dim
        return {"q": q_rows, "k": kv_rows, "v": kv_rows, None: q_rows + 2 * kv_rows}[shard_id]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        if shard_id is None:  # a checkpoint that already fuses q, k and v (Phi-3's qkv_proj)
            q_rows = self.total_num_heads * self.head_dim
            kv_rows = self.total_num_kv_heads * self.head_dim
            parts = _split_rows(loaded_weight, [q_rows, kv_rows, kv_rows])
            for part_id, part in zip("qkv", parts):
                self.weight_loader(param, part, part_id)
            return
        if shard_id == "q":
            offset, size, rank = 0, self.q_size, self.tp_rank
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, rank = self.kv_size, self.tp_rank // self.kv_head_replicas
        else:
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        part = loaded_weight.narrow(0, rank * size, size)
        default_weight_loader(param.narrow(0, offset, size), part)  # type: ignore[arg-type]

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial products are summed by an all-reduce."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__(divide(input_size, tp_size), output_size, bias, tp_rank, tp_size)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        if param.dim() == 1:  # the bias is not split; only rank 0 adds it (see forward)
            default_weight_loader(param, loaded_weight)
            return
        size = param.shape[1]
        default_weight_loader(param, loaded_weight.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Adding the bias on one rank only keeps it from being summed tp_size times.
        bias = self.bias if self.tp_rank == 0 else None
        partial = self.matmul(x, bias)
        if self.lora is not None:  # a partial correction too: A holds this rank's columns
            partial = self.lora.add_to(x, partial)
        return self.all_reduce(partial)

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return all_reduce(partial, self.tp_size)
