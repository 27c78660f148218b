"""python -m benchmarks wire: one JSON object; the diff stays small while the full resend grows."""

from __future__ import annotations

import json
import subprocess

from tests.commands import CHECKOUT, LAB


def test_bench_wire_json_shows_a_diff_independent_of_prompt_length():
    command = [*LAB, "wire", "--json", "--requests", "32", "--prompt-lens", "100", "2000"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=CHECKOUT)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["machine"]["num_cpus"] >= 1 and report["config"]["requests"] == 32
    short, long = report["rows"]
    assert (short["prompt_len"], long["prompt_len"]) == (100, 2000)
    # 20x the prompt: the full resend grows about 20x, the diff only by wider integers.
    assert long["full_bytes"] > 10 * short["full_bytes"]
    assert long["diff_bytes_mean"] < 1.5 * short["diff_bytes_mean"]
    assert long["diff_bytes_mean"] < 32 * 20
