"""``python -m benchmarks moe``: every variant agrees with the plain grouping (int8 with its own
dequantized weights) and is timed, on both shapes."""

from __future__ import annotations

from benchmarks import moe
from conveyor.worker.layers.int8_linear import load_int8_gemm


def test_every_variant_is_checked_and_timed(capsys):
    assert moe.main(["--rows", "3", "--budget", "0.01"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("T=3")]
    assert len(rows) == len(moe.SHAPES)
    names = ["packed", "grouped", "grouped_mm", "all_experts", "gathered"]
    if load_int8_gemm() is not None:
        names.append("int8")
    for row in rows:
        assert [name for name in names if f" {name} " in row] == names
