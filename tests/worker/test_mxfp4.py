"""MXFP4 unpacking, against transformers' own dequantizer and against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from conveyor.worker.layers.mxfp4 import dequantize_mxfp4


def test_codes_and_scales_decode_as_the_format_defines():
    # One block: byte i holds code 2i % 16 (low nibble) and (2i + 1) % 16 (high nibble).
    codes = torch.arange(32) % 16
    blocks = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).view(1, 16)
    values = dequantize_mxfp4(blocks, torch.tensor([127 + 2], dtype=torch.uint8))
    magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    expected = [4 * m for m in magnitudes] + [-4 * m for m in magnitudes]
    assert values.tolist() == expected * 2


def test_matches_transformers_dequantizer_bit_for_bit():
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 10, 4), generator=generator, dtype=torch.uint8)
    theirs = _convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    # transformers also transposes to its [experts, in, out] layout; ours stays [.., out, in].
    assert torch.equal(dequantize_mxfp4(blocks, scales).transpose(1, 2), theirs)
    bf16 = dequantize_mxfp4(blocks, scales, torch.bfloat16)
    assert torch.equal(bf16.float(), dequantize_mxfp4(blocks, scales))  # exact in bf16


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(
            torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8)
        )
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(torch.zeros(2, 16), torch.zeros(2, dtype=torch.uint8))
