"""python -m benchmarks soak end to end, shortened: a real server, load with cancellations, samples, checks.

Runs the script as a subprocess for 12 s of load at a rate well under the tiny model's capacity
(given, so no probe), sampling every 3 s; the long run is in docs/reliability.md.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.commands import LAB

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_a_short_soak_passes_and_reports_every_process(tiny_model_dir, tmp_path):
    result_json = tmp_path / "soak.json"
    command = [*LAB, "soak", "--minutes", "0.2"]
    command += ["--model", str(tiny_model_dir), "--rate", "5", "--sample-interval-s", "3"]
    command += ["--input-len", "32", "--output-len", "32", "--cancel-rate", "0.2"]
    # A run this short is mostly warm-up: the worker's allocator grows with each new batch size.
    command += ["--warmup-fraction", "0.6"]
    command += ["--serve-args", "--kv-cache-memory 16M", "--result-json", str(result_json)]
    command += ["--work-dir", str(tmp_path / "work")]  # not a folder left in the system's /tmp
    run = subprocess.run(command, capture_output=True, text=True, timeout=150, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(result_json.read_text())
    assert result["passed"] and result["rate_req_s"] == pytest.approx(3.5)
    assert set(result["checks"]) == {"no_failures", "memory_flat", "all_blocks_free_after",
                                     "clean_exit"}  # fmt: skip
    load = result["load"]
    assert load["completed"] > 10 and load["failed"] == 0 and load["cancelled"] > 0
    samples = result["samples"]
    assert len(samples) >= 4 and samples[-1]["after_load"]
    assert set(samples[0]["rss_mib"]) == {"serve", "engine_core", "worker-0", "frontend-0"}
    assert all(mib > 10 for mib in samples[-1]["rss_mib"].values())
    assert samples[-1]["free_blocks"] == result["num_kv_blocks"]
    assert "| t (s) |" in run.stdout and "PASS all_blocks_free_after" in run.stdout
    work = tmp_path / "work"
    assert f"files: {work}" in run.stdout and (work / "soak.log").exists()
    assert result["server_log"] == str(work / "serve.log")
