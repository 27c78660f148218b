"""conveyor bench offline: its workloads and its one-line JSON report, on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from conveyor.bench import offline as bench
from conveyor.bench.machine import tree_cpu_seconds


def test_workloads_have_the_promised_shapes_and_are_seeded():
    prompts, params = bench.make_requests("mix", 4, 1000, seed=0)
    assert [len(p) for p in prompts] == [32, 512, 32, 512]
    assert [p.max_tokens for p in params] == [32, 128, 32, 128]
    assert all(p.ignore_eos and p.temperature == 0.0 for p in params)
    assert all(0 <= t < 1000 for p in prompts for t in p)
    assert bench.make_requests("mix", 4, 1000, seed=0)[0] == prompts
    equal, _ = bench.make_requests("equal", 3, 1000, seed=0)
    assert [len(p) for p in equal] == [128] * 3


def test_uneven_lengths_are_long_tailed_fixed_and_fit_the_context():
    shapes = bench.WORKLOADS["uneven"]
    # The same lengths in every process (both engines of bench reference, every pair).
    assert shapes == bench.long_tailed_shapes(len(shapes))
    prompts = sorted(p for p, _ in shapes[:64])
    outputs = sorted(o for _, o in shapes[:64])
    # Long-tailed: the longest are several times the median, the median well above the floor.
    assert prompts[-1] > 5 * prompts[32] and outputs[-1] > 5 * outputs[32]
    assert prompts[32] > 100 and outputs[32] > 30
    # The lengths docs/performance.md's `uneven` figures were measured on: a change to the draw
    # would make new runs incomparable with them.
    assert (sum(prompts), max(prompts), sum(outputs), max(outputs)) == (18784, 1310, 6992, 800)
    assert all(16 <= p <= 3000 and 4 <= o <= 800 for p, o in shapes)
    requests, params = bench.make_requests("uneven", 5, 1000, seed=3)
    assert [(len(r), q.max_tokens) for r, q in zip(requests, params, strict=True)] == shapes[:5]


def test_json_report(tiny_model_dir, capsys):
    argv = ["--model", str(tiny_model_dir), "--workload", "equal"]
    argv += ["--num-requests", "4", "--num-warmup-requests", "1", "--json"]
    argv += ["--kv-cache-memory", "32M", "--max-num-seqs", "4"]
    assert bench.main(argv) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    report = json.loads(line)
    assert report["num_output_tokens"] == 4 * 128 and report["num_prompt_tokens"] == 4 * 128
    expected_rate = report["num_output_tokens"] / report["seconds"]
    assert abs(report["output_tok_s"] - expected_rate) < 0.1 * expected_rate
    assert report["config"]["max_num_seqs"] == 4 and report["machine"]["num_cpus"] >= 1
    assert report["engine"] == "mp" and report["cpu_utilization"] > 0.0


@pytest.mark.slow
def test_compare_times_every_setup_on_the_same_prompts(tiny_model_dir, capsys):
    argv = ["--model", str(tiny_model_dir), "--workload", "mix", "--compare"]
    argv += ["--num-requests", "2", "--num-warmup-requests", "1", "--repeats", "1", "--json"]
    argv += ["--kv-cache-memory", "32M", "--max-num-seqs", "4"]
    assert bench.main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["runs"]) == {"inprocess", "mp_sync", "mp_async"}
    assert report["ratio_to_inprocess"]["inprocess"] == 1.0
    for name, (run,) in report["runs"].items():
        assert run["num_output_tokens"] == 32 + 128, name
        ratio = run["output_tok_s"] / report["best_output_tok_s"]["inprocess"]
        assert abs(ratio - report["ratio_to_inprocess"][name]) < 0.01
        # Positive for every setup; that child processes' CPU time is counted at all is
        # tested directly below (a threshold here would measure how busy the machine is).
        assert run["cpu_utilization"] > 0.0, name


def test_tree_cpu_seconds_counts_a_busy_child():
    """The engine and workers are child processes: bench offline's CPU use must include them."""
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\n"
    burn += "import sys\nsys.stdin.read()"  # stay alive (and counted) until told to go
    before = tree_cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30.0
        while tree_cpu_seconds() - before < 0.4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tree_cpu_seconds() - before >= 0.4
    finally:
        child.communicate(b"", timeout=10)


def test_phase_times_account_for_an_in_process_run(tiny_model_dir, capsys):
    from conveyor.engine_core.scheduler import Scheduler
    from conveyor.worker.attention.cpu_kernel import load_kernel
    from conveyor.worker.layers.linear import LinearBase

    schedule, matmul = Scheduler.schedule, LinearBase.matmul
    argv = ["--model", str(tiny_model_dir), "--workload", "mix", "--engine", "inprocess"]
    argv += ["--num-requests", "2", "--num-warmup-requests", "1", "--phase-times", "--json"]
    argv += ["--kv-cache-memory", "32M", "--max-num-seqs", "4"]
    assert bench.main(argv) == 0
    captured = capsys.readouterr()
    phases = json.loads(captured.out.strip().splitlines()[-1])["phases"]
    assert "forward_other" in captured.err and "linears" in captured.err  # the table
    num_layers = json.loads((tiny_model_dir / "config.json").read_text())["num_hidden_layers"]
    steps = phases["forward"]["calls"]
    assert steps >= 128 and phases["execute"]["calls"] == steps == phases["sample"]["calls"]
    # qkv, o, gate_up and down in every layer of every step; the kernel once per layer.
    assert phases["linears"]["calls"] == 4 * num_layers * steps
    if load_kernel() is not None:
        assert phases["attention"]["calls"] == num_layers * steps
    assert 0 < phases["linears"]["seconds"] < phases["forward"]["seconds"]
    for nested in ("runner_other", "forward_other", "engine_other"):
        assert phases[nested]["seconds"] >= 0, nested
    assert abs(sum(phases[p]["share"] for p in ("execute", "engine_other")) - 1) < 0.01
    # The wrappers are gone once the run is timed.
    assert Scheduler.schedule is schedule and LinearBase.matmul is matmul


def test_phase_times_needs_the_in_process_engine(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(["--phase-times"])
    assert exit_info.value.code == 2
    assert "--phase-times needs --engine inprocess" in capsys.readouterr().err


def _compare_spec_report(capsys, extra: list[str]) -> dict:
    argv = ["--compare-spec", "--engine", "inprocess", "--batch-sizes", "1,2"]
    argv += ["--spec-max-tokens", "12", "--repeats", "1", "--json", *extra]
    assert bench.main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_compare_spec_reports_each_batch_size_with_its_acceptance(capsys):
    report = _compare_spec_report(capsys, [])
    # vLLM's documented example, looked up as vLLM reads it: 4-grams only.
    assert report["speculative_config"]["num_speculative_tokens"] == 5
    assert [row["batch"] for row in report["results"]] == [1, 2]
    for row in report["results"]:
        assert row["plain_tok_s"] > 0 and row["spec_tok_s"] > 0
        assert row["ratio"] == pytest.approx(row["spec_tok_s"] / row["plain_tok_s"], abs=1e-3)
        assert 0.0 <= row["acceptance"] <= 1.0
        assert "draft_cost" not in row


def test_compare_spec_with_a_draft_model_reports_its_cost(capsys):
    # The default model drafting for itself: every draft agrees, whatever it costs.
    spec = json.dumps({"model": str(bench_default_model()), "num_speculative_tokens": 3})
    report = _compare_spec_report(capsys, ["--speculative-config", spec])
    for row in report["results"]:
        assert row["acceptance"] > 0.9
        assert row["draft_cost"] > 0


def bench_default_model():
    from conveyor.frontend.engine_args import DEFAULT_MODEL_DIR

    return DEFAULT_MODEL_DIR
