"""``python -m benchmarks tokenize``: every way tokenizes every prompt; on the loop, the loop stalls."""

from __future__ import annotations

import json

from benchmarks.tokenize import main


def test_json_report_times_every_way_on_both_workloads(tiny_model_dir, capsys):
    argv = ["--model", str(tiny_model_dir), "--requests", "64", "--large-requests", "2",
            "--large-chars", "200000", "--concurrency", "8", "--rounds", "1", "--json"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["concurrency"] == 8 and report["machine"]["num_cpus"] >= 1
    small, large = report["results"].values()
    for results in (small, large):
        assert set(results) == {"loop", "threads", "processes", "server"}
        assert all(row["requests_per_s"] > 0 for row in results.values())
        assert results["threads"]["vs_threads"] == 1.0
    # On the loop, a tokenize holds the loop for all of its time (1 / rate per request).
    on_loop = large["loop"]
    assert on_loop["loop_stall_ms"] >= 0.5 * 1e3 / on_loop["requests_per_s"], on_loop
