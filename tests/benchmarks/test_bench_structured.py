"""``python -m benchmarks structured``: the three batches produce the same tokens' worth of output and
the report carries their rates and step times."""

from __future__ import annotations

import json

import pytest

from benchmarks.structured import main


@pytest.mark.slow
def test_json_report_compares_plain_json_and_mixed_batches(tiny_model_dir, capsys):
    argv = ["--model", str(tiny_model_dir), "--num-requests", "4", "--output-len", "8",
            "--rounds", "1", "--json"]  # fmt: skip
    assert main(argv) == 0  # it asserts itself that every batch wrote 4 x 8 tokens
    report = json.loads(capsys.readouterr().out)
    results = report["results"]
    assert set(results) == {"plain", "json", "mixed"} and results["plain"]["vs_plain"] == 1.0
    for row in results.values():
        assert row["output_tok_per_s"] > 0 and 0 < row["step_p50_ms"] <= row["step_p99_ms"]
