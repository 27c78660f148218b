"""One layer's LoRA slots against the dense formula, token by token.

``y_t = W x_t + sum over parts p of B_p A_p x_t`` (B already scaled) for a token of an adapter,
``W x_t`` for the base model's; on fused layers each part's correction lands in that part's
output rows. The step's tokens come in any order (several adapters interleaved with the base
model), in one contiguous run, or with slots in another dtype than the layer.
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
from conveyor.worker.lora.slots import LoRASlots
from conveyor.worker.lora.step_groups import StepGroups

HIDDEN, HEAD_DIM, HEADS, KV_HEADS, INTER = 32, 8, 4, 2, 48
MAX_RANK, NUM_SLOTS = 8, 3


def _layer(kind: str):
    torch.manual_seed(0)
    if kind == "qkv":
        layer = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS)
        parts = [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]
    elif kind == "gate_up":
        layer = MergedColumnParallelLinear(HIDDEN, [INTER, INTER])
        parts = [INTER, INTER]
    else:
        layer = RowParallelLinear(INTER, HIDDEN)
        parts = [HIDDEN]
    layer.weight.data.normal_()
    return layer, parts


def _adapter(parts: list[int], in_features: int, rank: int, which: list[int], seed: int):
    generator = torch.Generator().manual_seed(seed)
    return {
        p: (
            torch.randn(rank, in_features, generator=generator),
            torch.randn(parts[p], rank, generator=generator),
        )
        for p in which
    }


def _dense(x, layer, parts, adapters, token_slots):
    expected = x @ layer.weight.t()
    offsets = np.cumsum([0, *parts])
    for t, slot in enumerate(token_slots):
        if slot < 0:
            continue
        for p, (a, b) in adapters[slot].items():
            expected[t, offsets[p] : offsets[p + 1]] += b @ (a @ x[t])
    return expected


@pytest.mark.parametrize("kind", ["qkv", "gate_up", "down"])
@pytest.mark.parametrize(
    "token_slots",
    [
        [2, -1, 0, 2, 2, -1, 1, 0],  # interleaved: gathered by slot, scattered back
        [-1, -1, 1, 1, 1, -1],  # one contiguous run: no gather
        [0, 0, 0, 0],
    ],
    ids=["interleaved", "one-run", "all-one-slot"],
)
def test_slots_add_each_tokens_own_correction(kind, token_slots):
    layer, parts = _layer(kind)
    in_features = layer.weight.shape[1]
    groups = StepGroups()
    slots = LoRASlots(layer, len(parts), groups, NUM_SLOTS, MAX_RANK, torch.float32, "cpu")
    adapters = {
        0: _adapter(parts, in_features, 4, list(range(len(parts))), 1),
        1: _adapter(parts, in_features, MAX_RANK, [len(parts) - 1], 2),
        2: _adapter(parts, in_features, 2, [0], 3),
    }
    for slot, adapter in adapters.items():
        slots.load(slot, adapter)
    layer.lora = slots
    x = torch.randn(len(token_slots), in_features)
    groups.set_tokens(np.array(token_slots), torch.device("cpu"))
    expected = _dense(x, layer, parts, adapters, token_slots)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)


def test_slots_in_another_dtype_and_a_cleared_slot():
    layer, parts = _layer("qkv")
    groups = StepGroups()
    slots = LoRASlots(layer, 3, groups, NUM_SLOTS, MAX_RANK, torch.float64, "cpu")
    adapter = _adapter(parts, HIDDEN, 4, [0, 2], 5)
    slots.load(1, adapter)
    slots.load(0, adapter)
    slots.clear(0)  # a slot whose adapter left: nothing added, even if a token named it
    layer.lora = slots
    token_slots = [1, -1, 0, 1]
    x = torch.randn(4, HIDDEN)
    groups.set_tokens(np.array(token_slots), torch.device("cpu"))
    expected = _dense(x, layer, parts, {1: adapter, 0: {}}, token_slots)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)


def test_a_step_of_base_tokens_only_adds_nothing():
    layer, _ = _layer("down")
    groups = StepGroups()
    layer.lora = LoRASlots(layer, 1, groups, NUM_SLOTS, MAX_RANK, torch.float32, "cpu")
    groups.set_tokens(np.array([-1, -1]), torch.device("cpu"))
    x = torch.randn(2, INTER)
    torch.testing.assert_close(layer(x), x @ layer.weight.t())


def test_a_reloaded_slot_holds_only_the_new_adapter():
    """``clear`` zeroes only what the last adapter wrote (its ranks say where): after a full
    adapter, a smaller one on another part leaves the slot as a fresh slot would hold it."""
    layer, parts = _layer("qkv")
    groups = StepGroups()
    reused = LoRASlots(layer, 3, groups, NUM_SLOTS, MAX_RANK, torch.float32, "cpu")
    fresh = LoRASlots(layer, 3, StepGroups(), NUM_SLOTS, MAX_RANK, torch.float32, "cpu")
    reused.load(1, _adapter(parts, HIDDEN, MAX_RANK, [0, 1, 2], 6))
    second = _adapter(parts, HIDDEN, 2, [2], 7)
    reused.load(1, second)
    fresh.load(1, second)
    assert torch.equal(reused.a_t, fresh.a_t) and torch.equal(reused.b, fresh.b)
    assert reused.ranks[1].tolist() == [0, 0, 2]
    reused.clear(1)
    assert not reused.a_t.any() and not reused.b.any() and not reused.ranks.any()
