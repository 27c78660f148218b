"""How to run a mixture-of-experts layer's experts on CPU: the alternatives, timed per batch size.

    python -m benchmarks moe                       # both shapes, 1..1024 rows (python -m benchmarks.moe)
    python -m benchmarks moe --rows 1,16 --budget 1

Variants, all computing sum_k weight_k * expert_k(x) for the same routing:
  packed       what worker/layers/fused_moe.py does: sort the (token, slot) pairs by expert, run
               each active expert once over its rows (two matmuls), scatter back, sum the slots;
               each expert's weights in oneDNN's blocked layout (as gemm.py packs dense weights
               for small batches; float32 on CPU only).
  grouped      the same on the plain weights (MKL sgemm): what runs where nothing is packed.
  grouped_mm   the same grouping, both matmuls as one torch grouped_mm call each (no Python loop).
  gathered     every (token, slot) pair gathers its expert's weights and runs a batched matmul:
               no grouping, but a copy of k weight sets per token.
  all_experts  every expert over every token (one bmm each way), then pick k outputs per token:
               no data-dependent shapes, E/k times the arithmetic.
  int8         ``packed``'s grouping with every expert's matrices in int8 (``--quantization
               int8``, worker/layers/int8_linear.py); checked against the same grouping on its
               dequantized weights, since its results are the int8 weights'.

Timings are the best of interleaved rounds (benchmarks/layers.py's ``best_of``); the machine's
cores are shared, so compare within a row.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.layers import best_of, print_row
from conveyor.bench.machine import Timing, machine_info
from conveyor.worker.layers.fused_moe import MoEExperts, select_experts
from conveyor.worker.layers.int8_linear import load_int8_gemm

# (name, hidden, expert intermediate size, experts, k): Mixtral's shape (few wide experts, top-2)
# and Qwen3-MoE's (many narrow experts, top-8), scaled to the bench model's hidden size.
SHAPES = (("mixtral-like", 512, 1536, 8, 2), ("qwen3-moe-like", 512, 256, 64, 8))
# Beyond a few rows the gathered weight copies take seconds (10x the others at 16 rows).
GATHERED_MAX_ROWS = 16


def make_experts(hidden: int, inter: int, num_experts: int) -> MoEExperts:
    experts = MoEExperts(num_experts, hidden, inter)
    torch.nn.init.normal_(experts.gate_up_proj, std=hidden**-0.5)
    torch.nn.init.normal_(experts.down_proj, std=inter**-0.5)
    experts.process_weights_after_loading()
    return experts


def gathered(experts: MoEExperts, x, ids, weights):
    num_tokens, top_k = ids.shape
    flat = ids.flatten()
    rows = x.repeat_interleave(top_k, dim=0).unsqueeze(2)  # [S, H, 1]
    gate, up = torch.bmm(experts.gate_up_proj[flat], rows).squeeze(2).chunk(2, -1)
    out = torch.bmm(experts.down_proj[flat], (F.silu(gate) * up).unsqueeze(2)).squeeze(2)
    return (out * weights.flatten().unsqueeze(1)).view(num_tokens, top_k, -1).sum(1)


def all_experts(experts: MoEExperts, x, ids, weights):
    num_experts = experts.num_experts
    gate_up = torch.matmul(x.unsqueeze(0), experts.gate_up_proj.transpose(1, 2))  # [E, T, 2I]
    gate, up = gate_up.chunk(2, -1)
    out = torch.matmul(F.silu(gate) * up, experts.down_proj.transpose(1, 2))  # [E, T, H]
    tokens = torch.arange(x.shape[0]).unsqueeze(1).expand_as(ids)
    picked = out.view(num_experts, x.shape[0], -1)[ids, tokens]  # [T, k, H]
    return (picked * weights.unsqueeze(2)).sum(1)


def grouped_mm(experts: MoEExperts, x, ids, weights):
    num_tokens, top_k = ids.shape
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts.num_experts)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    rows = x[order // top_k]
    gate, up = F.grouped_mm(rows, experts.gate_up_proj.transpose(1, 2), offs=offsets).chunk(2, -1)
    out = F.grouped_mm(F.silu(gate) * up, experts.down_proj.transpose(1, 2), offs=offsets)
    weighted = out * weights.flatten()[order].unsqueeze(1)
    unsorted = torch.empty_like(weighted).index_copy_(0, order, weighted)
    return unsorted.view(num_tokens, top_k, -1).sum(1)


def int8_pair(experts: MoEExperts) -> tuple[MoEExperts, MoEExperts] | None:
    """(a copy with int8 experts, a float copy holding their dequantized weights), or None
    where the int8 kernel cannot be built."""
    if load_int8_gemm() is None:
        return None
    quantized, dequantized = _unpacked_copy(experts), _unpacked_copy(experts)
    quantized.quantize_int8()
    with torch.no_grad():
        for part, name in enumerate(("gate_up_proj", "down_proj")):
            stacked = getattr(dequantized, name)
            for e in range(experts.num_experts):
                stacked[e] = quantized.int8[e][part].dequantized()  # type: ignore[index]
    return quantized, dequantized


def _unpacked_copy(experts: MoEExperts) -> MoEExperts:
    """The same weights in a new layer, without the packed copies (which cannot be copied)."""
    hidden, inter = experts.down_proj.shape[1:]
    twin = MoEExperts(experts.num_experts, hidden, inter)
    with torch.no_grad():
        twin.gate_up_proj.copy_(experts.gate_up_proj)
        twin.down_proj.copy_(experts.down_proj)
    return twin


def variants(
    experts: MoEExperts, x, ids, weights, int8: tuple[MoEExperts, MoEExperts] | None = None
) -> dict[str, Callable[[], object]]:
    """``experts`` as loaded (packed where gemm.py would pack); the others on its plain weights."""
    table: dict[str, Callable[[], object]] = {}
    if experts.packed_weights is not None:
        table["packed"] = lambda: experts(x, ids, weights)
    unpacked = copy.copy(experts)
    unpacked.packed_weights = None
    table["grouped"] = lambda: unpacked(x, ids, weights)
    table["grouped_mm"] = lambda: grouped_mm(experts, x, ids, weights)
    table["all_experts"] = lambda: all_experts(experts, x, ids, weights)
    if x.shape[0] <= GATHERED_MAX_ROWS:
        table["gathered"] = lambda: gathered(experts, x, ids, weights)
    if int8 is not None:
        quantized, dequantized = int8
        table["int8"] = lambda: quantized(x, ids, weights)
        torch.testing.assert_close(
            table["int8"](), dequantized(x, ids, weights), rtol=1e-4, atol=1e-4, msg="int8"
        )
    return table


def check_agreement(table: dict[str, Callable[[], object]]) -> None:
    """Every variant computes the same thing (a benchmark of a wrong variant is worthless)."""
    reference = table["grouped"]()  # the plain weights
    for name, fn in table.items():
        if name == "int8":  # the int8 weights' results, checked in ``variants``
            continue
        torch.testing.assert_close(fn(), reference, rtol=1e-4, atol=1e-4, msg=name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks moe", description=__doc__)
    parser.add_argument("--rows", default="1,4,16,64,256,1024", help="tokens per step")
    parser.add_argument("--budget", type=float, default=2.0, help="seconds per row of the table")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    print(f"machine: {machine_info()}")
    for name, hidden, inter, num_experts, top_k in SHAPES:
        print(f"\n== {name}: hidden {hidden}, {num_experts} experts x {inter}, top-{top_k} ==")
        experts = make_experts(hidden, inter, num_experts)
        int8 = int8_pair(experts)
        router = torch.randn(num_experts, hidden) * 2 / hidden**0.5
        with Timing() as timing:
            for num_rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(num_rows, hidden)
                weights, ids = select_experts(x @ router.t(), top_k, renormalize=True)
                with torch.inference_mode():
                    table = variants(experts, x, ids, weights, int8)
                    check_agreement(table)
                    times = best_of(table, args.budget)
                active = len(ids.unique())
                print_row(f"T={num_rows:<5d} active={active:<3d}", times)
        # Other processes' share of the cores meanwhile: near 0 for numbers worth comparing.
        print(f"other_load {timing.summary()['other_load']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
