"""The grouped LoRA kernel (worker/lora/kernel.py) against the torch loop it replaces.

Both run on the same slots and the same step: uneven segments, a slot that was cleared, ranks 8,
16 and 64 (smaller than the slots' rank too), fused parts (q/k/v, gate/up) with part boundaries
off the vector width, tokens in slot order or interleaved with the base model's, float32 and
bfloat16, one thread and several. float32 agrees to float rounding; bfloat16 to its rounding,
since the loop rounds the shrunk rows to bfloat16 and the kernel keeps them in float32.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conveyor.worker.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from conveyor.worker.lora.kernel import KERNEL_ENV, kernel_enabled, load_lora_kernel
from conveyor.worker.lora.slots import LoRASlots
from conveyor.worker.lora.step_groups import StepGroups
from tests.env_switches import assert_refused, switch_set

pytestmark = pytest.mark.skipif(load_lora_kernel() is None, reason="no C compiler for the kernel")

NUM_SLOTS = 5


def _layer(kind: str, size: str):
    if size == "small":  # part sizes off every vector width: the column tails
        hidden, head_dim, heads, kv_heads, inter = 40, 12, 3, 1, 37
    else:  # the bench model's shapes
        hidden, head_dim, heads, kv_heads, inter = 512, 64, 8, 4, 1536
    if kind == "qkv":
        layer = QKVParallelLinear(hidden, head_dim, heads, kv_heads)
        parts = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    elif kind == "gate_up":
        layer = MergedColumnParallelLinear(hidden, [inter, inter])
        parts = [inter, inter]
    else:
        layer = RowParallelLinear(inter, hidden)
        parts = [hidden]
    return layer, parts


def _fill(slots: LoRASlots, parts: list[int], in_features: int, max_rank: int, seed: int):
    """Slot 0: every part at the full rank; 1: the last part at rank 8; 2: cleared after a
    load; 3: the first part at rank 16 (a third of the slots' rank when it is 64); 4: all parts
    at rank 8, smaller than the slot's."""
    generator = torch.Generator().manual_seed(seed)

    def adapter(rank: int, which: list[int]):
        return {
            p: (
                torch.randn(rank, in_features, generator=generator) / in_features**0.5,
                torch.randn(parts[p], rank, generator=generator) / rank**0.5,
            )
            for p in which
        }

    every = list(range(len(parts)))
    slots.load(0, adapter(max_rank, every))
    slots.load(1, adapter(min(8, max_rank), [len(parts) - 1]))
    slots.load(2, adapter(max_rank, every))
    slots.clear(2)
    slots.load(3, adapter(min(16, max_rank), [0]))
    slots.load(4, adapter(min(8, max_rank), every))


def _token_slots(order: str, rng: np.random.Generator) -> np.ndarray:
    """A step's tokens: uneven runs (1 to 37 tokens) of every slot, and base-model tokens."""
    sizes = {slot: int(rng.integers(1, 38)) for slot in range(NUM_SLOTS)}
    sizes[-1] = 9
    tokens = np.concatenate([np.full(n, slot) for slot, n in sizes.items()])
    if order == "sorted":  # what the model runner hands over: base rows, then slot by slot
        return np.sort(tokens)
    return rng.permutation(tokens)


def _both(slots: LoRASlots, x: torch.Tensor, out: torch.Tensor):
    expected = slots.add_with_torch(x, out.clone())
    assert slots.kernel is not None
    got = slots.add_to(x, out.clone())
    return got, expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("order", ["sorted", "interleaved"])
@pytest.mark.parametrize("max_rank", [8, 16, 64])
@pytest.mark.parametrize("kind", ["qkv", "gate_up", "down"])
def test_the_kernel_adds_what_the_torch_loop_adds(kind, max_rank, order, dtype):
    layer, parts = _layer(kind, "small")
    in_features = layer.weight.shape[1]
    groups = StepGroups()
    slots = LoRASlots(layer, len(parts), groups, NUM_SLOTS, max_rank, dtype, torch.device("cpu"))
    _fill(slots, parts, in_features, max_rank, seed=max_rank)
    rng = np.random.default_rng(max_rank)
    token_slots = _token_slots(order, rng)
    groups.set_tokens(token_slots, torch.device("cpu"))
    assert (groups.perm is None) == (order == "sorted")
    x = torch.randn(len(token_slots), in_features).to(dtype)
    out = torch.randn(len(token_slots), sum(parts)).to(dtype)
    got, expected = _both(slots, x, out)
    assert torch.equal(got[token_slots < 0], out[token_slots < 0])  # base tokens untouched
    assert torch.equal(got[token_slots == 2], out[token_slots == 2])  # the cleared slot
    tolerance = (
        {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 0.02, "atol": 0.02}
    )
    torch.testing.assert_close(got, expected, **tolerance)
    assert not torch.equal(got, out)


@pytest.mark.parametrize("kind", ["qkv", "gate_up", "down"])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_the_kernel_on_the_bench_shapes_with_one_and_two_threads(kind, num_threads):
    """Large enough to run in parallel: each thread's share of the panels, same result."""
    layer, parts = _layer(kind, "bench")
    in_features = layer.weight.shape[1]
    groups = StepGroups()
    slots = LoRASlots(layer, len(parts), groups, NUM_SLOTS, 16, torch.float32, torch.device("cpu"))
    _fill(slots, parts, in_features, 16, seed=7)
    token_slots = _token_slots("sorted", np.random.default_rng(7))
    groups.set_tokens(token_slots, torch.device("cpu"))
    x = torch.randn(len(token_slots), in_features)
    out = torch.randn(len(token_slots), sum(parts))
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        got, expected = _both(slots, x, out)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_bfloat16_activations_with_float32_slots():
    """--lora-dtype float32 under a bfloat16 model: the kernel reads each in its own dtype."""
    layer, parts = _layer("down", "small")
    groups = StepGroups()
    slots = LoRASlots(layer, 1, groups, NUM_SLOTS, 8, torch.float32, torch.device("cpu"))
    _fill(slots, parts, layer.weight.shape[1], 8, seed=3)
    token_slots = _token_slots("sorted", np.random.default_rng(3))
    groups.set_tokens(token_slots, torch.device("cpu"))
    x = torch.randn(len(token_slots), layer.weight.shape[1]).to(torch.bfloat16)
    out = torch.randn(len(token_slots), parts[0]).to(torch.bfloat16)
    got, expected = _both(slots, x, out)
    torch.testing.assert_close(got, expected, rtol=0.02, atol=0.02)


def test_the_switch_turns_the_kernel_off_and_refuses_a_typo(monkeypatch):
    layer, _ = _layer("down", "small")

    def make() -> LoRASlots:
        return LoRASlots(layer, 1, StepGroups(), 2, 8, torch.float32, torch.device("cpu"))

    assert make().kernel is not None
    with switch_set(monkeypatch, KERNEL_ENV, "off", kernel_enabled):
        assert make().kernel is None
    assert_refused(monkeypatch, KERNEL_ENV, "sometimes", kernel_enabled)
    # float16 slots are the loop's: the kernel reads float32 and bfloat16 only.
    float16 = LoRASlots(layer, 1, StepGroups(), 2, 8, torch.float16, torch.device("cpu"))
    assert float16.kernel is None
