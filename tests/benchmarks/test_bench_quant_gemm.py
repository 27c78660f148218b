"""``python -m benchmarks quant-gemm``: refused without a GPU; its weights plan on any device."""

from __future__ import annotations

import pytest

from benchmarks import quant_gemm
from conveyor.worker.attention.triton_backend import triton_import_error
from conveyor.worker.layers.quantization import triton_quant


def test_it_is_refused_without_cuda(capsys):
    with pytest.raises(SystemExit) as raised:
        quant_gemm.main(["--rows", "1"])
    assert raised.value.code == 2
    assert "no CUDA GPU" in capsys.readouterr().err


@pytest.mark.skipif(triton_import_error() is not None, reason="needs triton")
def test_every_scheme_it_times_has_a_kernel_plan():
    for name, scheme in quant_gemm._schemes().items():
        quant = quant_gemm.random_weights(scheme, 256, 256, "cpu")
        plan = triton_quant.make_plan(quant, fp8_matmul=True)
        assert plan is not None, name
        assert plan.scaled_mm == name.startswith("fp8 w8a8"), name
        assert (plan.g_idx is not None) == ("act-order" in name), name
