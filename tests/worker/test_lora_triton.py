"""The Triton LoRA kernels (worker/lora/triton_lora.py) against the exact correction.

On the CPU they run under Triton's interpreter (TRITON_INTERPRET=1, set by tests/devices.py):
the same kernel source, each program executed with numpy; with CONVEYOR_TEST_DEVICE=cuda they
are compiled and run on the GPU. The step mixes slots in any token order, with base-model tokens
(-1) between them, slots whose adapter uses fewer rank columns than the slot's width, and input
and output sizes that are not whole blocks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conveyor.worker.attention.triton_backend import triton_import_error
from conveyor.worker.lora import triton_lora
from conveyor.worker.lora.step_groups import StepGroups
from tests.devices import TEST_DEVICE

pytestmark = [
    pytest.mark.gpu_kernel,
    pytest.mark.skipif(
        triton_import_error() is not None, reason=f"needs triton ({triton_import_error()})"
    ),
]
DEVICE = torch.device("cuda" if TEST_DEVICE == "cuda" else "cpu")


def _slots(num_slots, in_features, width, out_features, used_ranks, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    a_t = torch.randn(num_slots, in_features, width, generator=generator) / in_features**0.5
    b = torch.randn(num_slots, width, out_features, generator=generator) * 0.5
    for slot, used in enumerate(used_ranks):  # an adapter of a smaller rank: zeros past it
        a_t[slot, :, used:] = 0
        b[slot, used:] = 0
    return a_t.to(dtype), b.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "in_features,width,out_features", [(96, 48, 80), (64, 16, 64), (130, 24, 200)]
)
def test_every_token_gets_its_own_slots_correction(dtype, in_features, width, out_features):
    token_slots = np.array([2, -1, 0, 0, 2, 1, -1, 3, 0, 2], dtype=np.int64)
    a_t, b = _slots(4, in_features, width, out_features, [width, width // 2, 8, width], dtype, 3)
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(len(token_slots), in_features, generator=generator).to(dtype)
    out = torch.randn(len(token_slots), out_features, generator=generator).to(dtype)
    expected = out.double().clone()
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            expected[t] += x[t].double() @ a_t[slot].double() @ b[slot].double()
    slots = torch.from_numpy(token_slots.astype(np.int32))
    got = out.to(DEVICE)
    done = triton_lora.add(x.to(DEVICE), got, slots.to(DEVICE), a_t.to(DEVICE), b.to(DEVICE))
    assert done and triton_lora.failure is None
    got = got.cpu()
    base = token_slots < 0
    assert torch.equal(got[torch.from_numpy(base)], out[torch.from_numpy(base)])  # untouched
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    else:
        # Summed in float32 and rounded once (the interpreter truncates where a GPU rounds).
        torch.testing.assert_close(got.double(), expected, rtol=2**-7, atol=2**-7)


def test_a_step_without_tokens_launches_nothing():
    a_t, b = _slots(1, 32, 16, 32, [16], torch.float32, 1)
    empty = torch.empty(0, 32)
    assert triton_lora.add(empty, torch.empty(0, 32), torch.empty(0, dtype=torch.int32), a_t, b)


def test_the_step_groups_keep_token_slots_on_cuda_only():
    groups = StepGroups()
    groups.set_tokens(np.array([1, -1, 0]), torch.device("cpu"))
    assert groups.token_slots is None and groups.segments  # the CPU's kernel reads segments
    if torch.cuda.is_available():
        groups.set_tokens(np.array([1, -1, 0]), torch.device("cuda"))
        assert groups.token_slots.tolist() == [1, -1, 0]
        assert groups.token_slots.dtype == torch.int32
    groups.clear()
    assert groups.token_slots is None


def test_width_blocks_are_powers_of_two():
    assert [triton_lora.width_block(w) for w in (1, 16, 17, 48, 64, 192)] == [
        16,
        16,
        32,
        64,
        64,
        256,
    ]
