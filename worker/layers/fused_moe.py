"""The mixture-of-experts MLP: a router picks k experts per token, each expert is a SwiGLU MLP.

Runs in worker processes. The experts' weights are stacked, one parameter for every expert's
[gate; up] and one for every down projection, and a step runs each expert that has tokens once,
over all of them: the step's (token, slot) pairs are sorted by expert, each active expert does one
gate/up matmul, SiLU-and-mul and one down matmul over its contiguous run of rows, and the weighted
rows go back to their tokens. Experts nobody picked cost nothing. On CPU in float32 each
expert's matrices also get the oneDNN-packed copy the dense layers keep for small batches; with
``--quantization int8`` each expert's matrices are int8 instead (``quantize_int8``), which matters
most here: a decode step reads the weights of every expert its tokens picked. A quantized
checkpoint's experts (``use_quantized_weights``) load as one quantized linear pair per expert;
quantization/experts.py says which schemes run and how.
Of the five ways ``python -m benchmarks moe`` times on CPU, this one with packed weights was the
fastest at 1-1,024 tokens: every expert over every token costs E/k times the arithmetic, and
gathering each token's expert weights copies k weight sets per token (3-36x slower).

Tensor parallelism splits every expert's intermediate dimension across the ranks, as a dense MLP
is split: gate/up column-parallel, down row-parallel, so each rank computes a partial sum of every
expert's output, and one all-reduce after the weighted sum finishes the layer. The router is small
and replicated, so every rank routes identically without a collective.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.worker.layers.gemm import linear, pack_weight
from conveyor.worker.layers.int8_linear import Int8Weight
from conveyor.worker.layers.linear import ReplicatedLinear
from conveyor.worker.layers.parallel import all_reduce, divide
from conveyor.worker.layers.quantization.experts import QuantizedExpert, check_expert_scheme
from conveyor.worker.layers.quantization.scheme import FLOAT8, LinearScheme

# Which part of which expert a checkpoint tensor fills: (expert index, "gate" | "up" | "down").
ExpertShardId = tuple[int, str]
GATE_UP_PARTS = ("gate", "up")


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router logits [T, E] -> (routing weights [T, k] float32, expert ids [T, k] int64).

    As Hugging Face computes it: softmax in float32 over all experts, the top k of those
    probabilities, and (renormalize) divided by their sum so a token's weights add up to one.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, expert_ids


class MoEExperts(nn.Module):
    """Every expert's SwiGLU weights, stacked; runs each expert that has tokens once."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.full_intermediate_size = intermediate_size
        self.intermediate_size = divide(intermediate_size, tp_size)  # this rank's share
        size = self.intermediate_size
        # [gate_r; up_r] per expert, as MergedColumnParallelLinear lays out a dense MLP.
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * size, hidden_size), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, size), requires_grad=False
        )
        for param in (self.gate_up_proj, self.down_proj):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        # Each expert's (gate_up, down) in oneDNN's blocked layout for small batches, as the
        # dense layers keep them (gemm.py); derived after loading, never saved.
        self.packed_weights: list[tuple[torch.Tensor | None, torch.Tensor | None]] | None = None
        # Each expert's (gate_up, down) in int8 once ``quantize_int8`` ran.
        self.int8: list[tuple[Int8Weight, Int8Weight]] | None = None
        # A quantized checkpoint's scheme, once ``use_quantized_weights`` ran: each expert's
        # linears are then the children "0", "1", ... (QuantizedExpert).
        self.quant_scheme: LinearScheme | None = None

    def use_quantized_weights(self, scheme: LinearScheme) -> None:
        """Load a quantized checkpoint's experts: one QuantizedExpert per expert, named by its
        index as the checkpoint names it; the float stacks stay as shapes on the meta device
        (FP8 experts get them back, multiplied out, after loading)."""
        check_expert_scheme(scheme)
        hidden_size = self.down_proj.shape[1]
        for e in range(self.num_experts):
            expert = QuantizedExpert(
                scheme, hidden_size, self.full_intermediate_size, self.tp_rank, self.tp_size
            )
            self.add_module(str(e), expert)
        self.quant_scheme = scheme
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(self, name)
            del self._parameters[name]
            setattr(self, name, torch.empty(param.shape, dtype=param.dtype, device="meta"))

    def quantized_expert(self, expert: int) -> QuantizedExpert:
        return self.get_submodule(str(expert))  # type: ignore[return-value]

    def process_weights_after_loading(self) -> None:
        if self.int8 is not None:
            return
        if self.quant_scheme is not None and self.quant_scheme.weights.kind != FLOAT8:
            return  # each expert's linears move into the 4-bit kernel's layout themselves
        if self.quant_scheme is not None:
            self._multiply_out_fp8_experts()
        packed = [
            (pack_weight(self.gate_up_proj[e]), pack_weight(self.down_proj[e]))
            for e in range(self.num_experts)
        ]
        self.packed_weights = packed if packed[0][0] is not None else None

    def quantize_int8(self) -> None:
        """Compute with int8 copies of every expert's matrices from now on and release the float
        ones (their shapes stay, on the meta device). Once is enough: a second call does nothing."""
        if self.int8 is not None:
            return
        self.int8 = [
            (Int8Weight(self.gate_up_proj[e], None), Int8Weight(self.down_proj[e], None))
            for e in range(self.num_experts)
        ]
        self.packed_weights = None
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(self, name)
            meta = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"), False)
            meta.weight_loader = self.weight_loader  # type: ignore[attr-defined]
            setattr(self, name, meta)

    def _multiply_out_fp8_experts(self) -> None:
        """FP8 experts -> float stacks in the model's dtype, the checkpoint layout released."""
        dtype = self.gate_up_proj.dtype  # the model's, kept on the meta stand-in
        stacks = []
        for part in (0, 1):
            linears = [
                (self.quantized_expert(e).gate_up_proj, self.quantized_expert(e).down_proj)[part]
                for e in range(self.num_experts)
            ]
            stacks.append(torch.stack([layer.quant.dequantized(dtype) for layer in linears]))
        for e in range(self.num_experts):
            delattr(self, str(e))
        self.quant_scheme = None
        self.gate_up_proj = nn.Parameter(stacks[0], requires_grad=False)
        self.down_proj = nn.Parameter(stacks[1], requires_grad=False)

    def project(
        self, rows: torch.Tensor, expert: int, part: int, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """rows @ W^T (+ bias) for one expert's gate_up (part 0) or down (part 1) matrix."""
        if self.quant_scheme is not None:
            return self.quantized_expert(expert).project(rows, part, bias)
        if self.int8 is not None:
            return self.int8[expert][part].linear(rows, with_bias=False, add=bias)
        weight = (self.gate_up_proj, self.down_proj)[part][expert]
        packed = self.packed_weights[expert][part] if self.packed_weights else None
        return linear(rows, weight, bias, packed)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ExpertShardId | None
    ) -> None:
        """Copy this rank's slice of one expert's gate, up ([I, hidden]) or down ([hidden, I])."""
        if self.int8 is not None:
            raise ValueError("int8-quantized experts cannot load new weights; reload the model")
        self.packed_weights = None  # stale once a weight changes; rebuilt after loading
        if not isinstance(shard_id, tuple):
            raise ValueError("stacked experts load one expert's gate, up or down at a time")
        expert, part = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range (the layer has {self.num_experts})")
        size, start = self.intermediate_size, self.tp_rank * self.intermediate_size
        if param is self.gate_up_proj and part in GATE_UP_PARTS:
            target = param[expert].narrow(0, GATE_UP_PARTS.index(part) * size, size)
            source = loaded_weight.narrow(0, start, size)
        elif param is self.down_proj and part == "down":
            target, source = param[expert], loaded_weight.narrow(1, start, size)
        else:
            raise ValueError(f"shard {shard_id!r} does not belong in this parameter")
        if target.shape != source.shape:
            raise ValueError(
                f"shape mismatch: expert slice {tuple(target.shape)}, checkpoint "
                f"{tuple(loaded_weight.shape)}"
            )
        target.copy_(source)

    def forward(
        self, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """hidden [T, H], expert ids and routing weights [T, k] -> sum_k weight * expert(x).

        The product is formed in ``weights``' dtype and the k rows summed before rounding to
        hidden's dtype, the order Hugging Face's grouped experts use.
        """
        num_tokens, top_k = expert_ids.shape
        flat_ids = expert_ids.flatten()
        # Stable, so a token's slots stay in slot order within an expert's run.
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        rows = self._run_experts(hidden[order // top_k], counts)
        weighted = rows * weights.flatten()[order].unsqueeze(1)
        # Back to (token, slot) order, then one reduction over the slots: deterministic (no
        # atomics on a GPU) where an index_add_ of duplicate token ids is not.
        unsorted = torch.empty_like(weighted).index_copy_(0, order, weighted)
        return unsorted.view(num_tokens, top_k, rows.shape[1]).sum(dim=1).to(hidden.dtype)

    def _run_experts(self, sorted_hidden: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows grouped by expert [S, H] and each expert's row count -> expert outputs [S, H]."""
        out = sorted_hidden.new_empty(sorted_hidden.shape[0], self.down_proj.shape[1])
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            end = start + count
            out[start:end] = self._expert(sorted_hidden[start:end], expert)
            start = end
        return out

    def _expert(self, rows: torch.Tensor, expert: int) -> torch.Tensor:
        """One expert over its rows: down(silu(gate(x)) * up(x)). A family with another expert
        (gpt-oss: biases, a clamped SwiGLU) overrides this and keeps the grouping above."""
        gate, up = self.project(rows, expert, 0).chunk(2, -1)
        return self.project(F.silu(gate).mul_(up), expert, 1)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.down_proj.shape[1]}, "
            f"intermediate_size={self.intermediate_size} (this rank)"
        )


class FusedMoE(nn.Module):
    """The sparse MLP block: router (``gate``), then the k chosen experts' weighted sum.

    ``renormalize``: the top-k weights are divided by their sum (Mixtral always; Qwen3-MoE when
    ``norm_topk_prob``). ``weights_in_hidden_dtype``: the weights are rounded to the hidden dtype
    before they scale the experts' outputs (Qwen3-MoE), or stay float32 (Mixtral); the same in
    float32, a rounding difference in bfloat16 that Hugging Face makes per family.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        weights_in_hidden_dtype: bool,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in 1..{num_experts}, got {top_k}")
        self.top_k = top_k
        self.renormalize = renormalize
        self.weights_in_hidden_dtype = weights_in_hidden_dtype
        self.tp_size = tp_size
        self.gate = ReplicatedLinear(hidden_size, num_experts, False, tp_rank, tp_size)
        self.experts = MoEExperts(num_experts, hidden_size, intermediate_size, tp_rank, tp_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = select_experts(self.gate(hidden), self.top_k, self.renormalize)
        if self.weights_in_hidden_dtype:
            weights = weights.to(hidden.dtype)
        # Each rank summed its share of every expert's intermediate features.
        return all_reduce(self.experts(hidden, expert_ids, weights), self.tp_size)

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, renormalize={self.renormalize}"
