"""``python -m benchmarks lora`` and ``lora-kernel``: the reports carry every batch and way,
with the kernel's engine and the loop's engine both serving every batch."""

from __future__ import annotations

import json

import pytest

from benchmarks import lora, lora_kernel


@pytest.mark.slow
def test_lora_report_compares_the_kernel_and_the_loop(tiny_model_dir, capsys):
    argv = ["--model", str(tiny_model_dir), "--num-requests", "4", "--output-len", "4",
            "--rank", "8", "--adapters", "1", "2", "--rounds", "2", "--compare-loop",
            "--engine", "inprocess", "--json"]  # fmt: skip
    assert lora.main(argv) == 0  # it asserts itself that every batch wrote 4 x 4 tokens
    results = json.loads(capsys.readouterr().out)["results"]
    assert set(results) == {"kernel", "loop"}
    for variant, rows in results.items():
        assert set(rows) == {"base", "loras-1", "loras-2"}
        assert rows["base"]["vs_base"] == 1.0 and rows["loras-1"]["step_p50_vs_fewest"] == 1.0
        for row in rows.values():
            assert row["output_tok_per_s"] > 0 and row["step_p50_ms"] > 0
            assert ("kernel_vs_loop" in row) == (variant == "kernel")


def test_lora_compare_eager_is_refused_without_cuda(tiny_model_dir, capsys):
    # The CPU never captures graphs: an "eager" engine beside it would measure nothing.
    with pytest.raises(SystemExit) as exit_info:
        lora.main(["--model", str(tiny_model_dir), "--compare-eager"])
    assert exit_info.value.code == 2
    assert "--compare-eager needs a CUDA device" in capsys.readouterr().err


@pytest.mark.slow
def test_lora_kernel_report_has_every_way_and_the_slot_fills(capsys):
    assert lora_kernel.main(["--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["results"]) == {"1", "4", "16"}
    for row in report["results"].values():
        assert min(row["base_us"], row["kernel_us"], row["loop_us"]) > 0
    fill = report["slot_fill"]
    assert fill["fill_from_host_lru_ms"] > 0 and fill["fill_from_files_ms"] > 0
