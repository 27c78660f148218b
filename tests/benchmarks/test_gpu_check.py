"""``python -m benchmarks gpu-check --dry-run``: the whole GPU check on CPU, tiny shapes, in a child process.

What it cannot do here (run the CUDA tests, capture graphs, count launches, read GPU memory) reads
"n/a" or is only collected; everything else (the wheel-less path, the model, the worker driven by
hand, the timings, the table and its JSON) runs for real.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.commands import LAB

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_the_dry_run_goes_end_to_end_on_cpu(tmp_path):
    report_file = tmp_path / "report.json"
    command = [*LAB, "gpu-check", "--dry-run", "--steps", "2", "--json", str(report_file)]
    # One offline workload: a second runs the same path (parse_args' test covers the list).
    command += ["--compare-backend", "torch", "--offline", "mix", "--offline-requests", "4"]
    # From the checkout: gpu-check finds the CUDA tests there, and collects them.
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "| batch | graphs ms/step | graphs tok/s | eager ms/step" in result.stdout
    report = json.loads(report_file.read_text())
    assert report["device_name"] == "CPU" and report["dtype"] == "float32"
    assert [row["batch"] for row in report["decode"]] == [1, 16, 64, 256]
    for row in report["decode"]:
        assert row["eager_s"] > 0
        assert row["graphs_s"] is row["eager_launches"] is row["graphs_launches"] is None
    assert [row["prompt_len"] for row in report["prefill"]] == [128, 512, 2048]
    assert report["peak_memory"] is None and report["weight_read_s"] > 0
    assert report["graph_bytes"] is report["profiled_graph_bytes"] is None  # CUDA's alone
    assert "the memory profile set aside n/a for them" in result.stdout
    # A step's read limit: the weights once, and each request's context K/V (2 x layers x KV
    # heads x head dim floats a token; the tiny model: 2 layers, 2 KV heads of 16).
    assert report["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    per_request = 32 * report["kv_bytes_per_token"] / report["bandwidth"]
    for batch in (1, 256):
        expected = report["weight_read_s"] + batch * per_request
        assert report["read_limit_s"][str(batch)] == pytest.approx(expected)
    assert "| read limit ms | best / read limit |" in result.stdout
    assert report["token_ops"].startswith("torch (CPU")  # what ran the small ops, named
    # The Triton attention kernel's tile shapes beside its defaults (the interpreter here).
    for phase in ("decode", "prefill"):
        table = report["attention_sweeps"][phase]
        assert "config: default, 16x32," in table and "failed" not in table
        assert f"Triton attention tile shapes, {phase}" in result.stdout
    # The same measurement with the other backend, and the offline runs through the engine.
    comparison = report["comparison"]
    assert [row["batch"] for row in comparison["decode"]] == [1, 16, 64, 256]
    assert all(row["eager_s"] > 0 for row in comparison["decode"])
    assert "With attention backend torch, same process:" in result.stdout
    assert [run["workload"] for run in report["offline"]] == ["mix"]
    for run in report["offline"]:
        assert "error" not in run and run["num_requests"] == 4 and run["output_tok_s"] > 0
    assert "| offline workload | requests | output tok/s |" in result.stdout
    # The CUDA tests are collected (they would skip here), not run; so are the parity tests.
    assert "collected" in report["tests"] and "error" not in report["tests"]
    assert "collected" in report["parity"] and "error" not in report["parity"]
    assert "parity with transformers on CUDA: " in result.stdout


def test_a_test_run_stopped_at_its_time_limit_says_what_it_got_through():
    from benchmarks.gpu_check.check import summarize_stopped_run

    lines = [
        "tests/frontend/test_parity_hf.py::test_batch_of_mixed_lengths_matches_hf[qwen3] PASSED [  6%]",
        "tests/frontend/test_parity_hf.py::test_chunked_prefill_matches_hf[qwen3] PASSED [ 12%]",
        "tests/frontend/test_parity_hf.py::test_preemption_under_a_tiny_kv_pool_matches_hf[qwen3] "
        "FAILED [ 18%]",
        "tests/worker/test_cuda.py::test_two_gpus SKIPPED (needs two GPUs) [ 25%]",
        "some other output naming PASSED",
    ]
    assert summarize_stopped_run(lines, 150.0) == (
        "stopped after 150 s: 2 passed, 1 failed, 1 skipped "
        "(tests/frontend/test_parity_hf.py::test_preemption_under_a_tiny_kv_pool_matches_hf[qwen3])",
        False,
    )
    assert summarize_stopped_run(lines[:2] + lines[3:], 150.0) == (
        "stopped after 150 s: 2 passed, 1 skipped",
        True,
    )
    # An id with a space in it still counts; a run that finished nothing may have hung: not passed.
    spaced = ["tests/a.py::test_x[a b] PASSED [ 50%]"]
    assert summarize_stopped_run(spaced, 9.0) == ("stopped after 9 s: 1 passed", True)
    assert summarize_stopped_run(["collecting ..."], 5.0) == (
        "stopped after 5 s: no test finished",
        False,
    )


def test_its_flag_choices_are_the_engines_and_unknown_ones_are_refused():
    """gpu-check spells out the backends and workloads (it imports nothing of conveyor before
    installing it): they must be the engine's own, and a misspelling is refused, not ignored."""
    from benchmarks.gpu_check import check as gpu_check
    from conveyor.bench.offline import WORKLOADS
    from conveyor.protocol.config import ATTENTION_BACKENDS

    assert gpu_check.ATTENTION_BACKENDS == ATTENTION_BACKENDS
    assert tuple(sorted(WORKLOADS)) == gpu_check.OFFLINE_WORKLOADS
    assert gpu_check.parse_args(["--offline", "mix,"]).offline == ["mix"]
    assert gpu_check.parse_args(["--offline", ""]).offline == []
    for flags in (["--offline", "equal,mixed"], ["--compare-backend", "flash"]):
        with pytest.raises(SystemExit) as exit_info:
            gpu_check.parse_args(flags)
        assert exit_info.value.code == 2


def test_the_time_limit_stops_a_hung_test_and_what_it_started(tmp_path):
    """A test that hangs (and started a child that holds pytest's output open) is stopped at
    the limit with its whole process group; the stopped CUDA tests fail the check, a stopped
    sample of the parity file passes on what it got through."""
    from benchmarks.gpu_check.check import run_tests

    marker = tmp_path / "child.pid"
    test_file = tmp_path / "test_hangs.py"
    test_file.write_text(
        "import subprocess, time\n"
        "def test_fast():\n    pass\n"
        "def test_hangs():\n"
        f"    child = subprocess.Popen(['sleep', '300'])\n"
        f"    open({str(marker)!r}, 'w').write(str(child.pid))\n"
        "    time.sleep(300)\n"
    )
    # The limit leaves the child pytest room to start and pass test_fast on a loaded 2-core
    # host (4 s did not once in CI: "no test finished").
    for stopped_may_pass in (False, True):
        start = time.monotonic()
        summary, passed = run_tests((str(test_file),), None, False, 600, 15.0, stopped_may_pass)
        assert time.monotonic() - start < 60
        assert summary == "stopped after 15 s: 1 passed" and passed is stopped_may_pass
        child = int(marker.read_text())
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (killed, not yet reaped by its dead parent's reaper) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:  # reaped in between
        return False


def test_the_attention_sweep_times_the_measured_models_shapes(tiny_model_dir):
    from benchmarks.gpu_check.check import SWEEP_CONFIGS, attention_sweep_command
    from benchmarks.gpu_check.measure import CheckPlan

    plan = CheckPlan(
        model_dir=tiny_model_dir,
        device="cuda",
        dtype="bfloat16",
        decode_batches=(1,),
        decode_context=256,
        decode_steps=1,
        prefill_lens=(2048,),
    )
    decode = attention_sweep_command(plan, "decode", dry_run=False)
    prefill = attention_sweep_command(plan, "prefill", dry_run=False)
    for command in (decode, prefill):
        flags = dict(zip(command[4::2], command[5::2]))
        assert flags["--backend"] == "triton" and flags["--dtype"] == "bfloat16"
        # The tiny model: 4 heads, 2 KV heads of 16 dims.
        assert (flags["--num-heads"], flags["--num-kv-heads"], flags["--head-dim"]) == (
            "4",
            "2",
            "16",
        )
    assert decode[-1] == SWEEP_CONFIGS["decode"] and "--chunk-lens" not in decode
    assert prefill[-1] == SWEEP_CONFIGS["prefill"]
    assert prefill[prefill.index("--chunk-lens") + 1] == "2048,8192"
