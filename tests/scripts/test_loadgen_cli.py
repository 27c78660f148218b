"""scripts/loadgen.py end to end: result JSON, plot, capacity search, Ctrl-C, self-test, cleanup."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import loadgen
import pytest
from loadgen_capacity import CapacitySpec, search_capacity

from tests.process_tree import descendants, kill_all, wait_until_gone
from tests.scripts.conftest import SCRIPTS

VLLM_KEYS = {
    "date",
    "backend",
    "model_id",
    "tokenizer_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
} | {
    f"{stat}_{name}_ms"
    for stat in ("mean", "median", "std", "p90", "p99")
    for name in ("ttft", "tpot", "itl", "e2el")
}


def test_result_json_has_vllm_keys_and_the_plot_is_written(fake_server, tmp_path, capsys):
    server = fake_server(itl_ms=1, api_key="sesame")
    out, png = tmp_path / "result.json", tmp_path / "plot.png"
    argv = ["--base-url", server.base_url, "--api-key", "sesame", "--num-prompts", "12"]
    argv += ["--random-input-len", "8", "--random-output-len", "6", "--request-rate", "200"]
    argv += ["--num-warmups", "2", "--goodput", "ttft:1000", "e2el:5000", "--no-progress"]
    argv += ["--result-json", str(out), "--plot", str(png), "--save-detailed"]
    assert loadgen.main(argv) == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Request goodput (req/s):" in printed
    result = json.loads(out.read_text())
    assert set(result) >= VLLM_KEYS
    assert result["model_id"] == "fake-model"  # asked of /v1/models
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["total_output_tokens"] == 72 and result["total_input_tokens"] == 96
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["request_rate"] == 200.0 and result["burstiness"] == 1.0
    assert len(result["itls"]) == 12 and len(result["itls"][0]) == 5
    assert result["args"]["api_key"] == "<redacted>" and result["args"]["num_warmups"] == 2
    assert result["machine"]["num_cpus"] >= 1
    # One ready check, two warm-ups, twelve measured.
    assert server.stats.num_requests == 15
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_capacity_bisection_on_a_known_curve():
    async def probe(rate: float) -> dict[str, float]:
        p99 = 10.0 if rate <= 37.0 else 100.0
        return {"p99_itl_ms": p99, "failed": 0, "completed": 20, "request_throughput": rate}

    lines: list[str] = []
    spec = CapacitySpec(slo_itl_p99_ms=50.0, start_rate=1.0, tolerance=0.02)
    found = asyncio.run(search_capacity(_with_output(probe), spec, lines.append))
    assert 37.0 * 0.98 <= found.capacity <= 37.0
    assert not found.is_lower_bound and len(lines) == len(found.probes)
    assert [p.request_rate for p in found.probes[:7]] == [1, 2, 4, 8, 16, 32, 64]

    # Failures break a probe whatever its latency; nothing holding gives no capacity.
    async def failing(rate: float) -> dict[str, float]:
        return {**await probe(rate), "failed": 1}

    none = asyncio.run(search_capacity(_with_output(failing), spec, lines.append))
    assert none.capacity is None and none.probes[-1].request_rate == spec.min_rate
    capped = CapacitySpec(50.0, max_rate=20.0)
    high = asyncio.run(search_capacity(_with_output(probe), capped, lines.append))
    assert high.capacity == 20.0 and high.is_lower_bound


def _with_output(probe):
    async def wrapped(rate: float) -> dict[str, float]:
        return {"output_throughput": 0.0, "mean_e2el_ms": 0.0, **await probe(rate)}

    return wrapped


@pytest.mark.slow
def test_capacity_search_finds_the_fake_servers_threshold(fake_server_process, tmp_path, capsys):
    # Evenly spaced arrivals of 10-token requests that each last T (9 gaps of 5 ms, plus
    # whatever the machine adds): about rate * T streams overlap, and past 4 of them every gap
    # is 100 ms. So the SLO breaks just above 4 / T req/s, T read from the probes that held.
    # (The server runs in its own process and the SLO sits far from both ITLs, so a busy
    # machine moves the threshold, which the test reads back, but not the verdicts.)
    base_url = fake_server_process("--itl-ms", "5", "--slow-itl-ms", "100", "--slow-above", "4")
    out = tmp_path / "capacity.json"
    argv = ["--base-url", base_url, "--num-prompts", "40", "--random-input-len", "8"]
    argv += ["--random-output-len", "10", "--burstiness", "inf", "--capacity-search"]
    argv += ["--slo-tbt-p99-ms", "50", "--capacity-start-rate", "40", "--no-progress"]
    argv += ["--result-json", str(out)]
    assert loadgen.main(argv) == 0
    result = json.loads(out.read_text())
    probes = result["capacity_probes"]
    assert any(not p["holds"] for p in probes)
    held = max((p for p in probes if p["holds"]), key=lambda p: p["request_rate"])
    threshold = 4 / (held["mean_e2el_ms"] / 1000)
    assert 30 <= threshold <= 90  # 4 / 45 ms at best; a busy machine stretches the sleeps
    assert 0.75 * threshold <= result["capacity_request_rate"] <= 1.1 * threshold
    assert "serving capacity:" in capsys.readouterr().out


def test_ctrl_c_stops_and_still_reports(fake_server):
    server = fake_server(itl_ms=50)  # 40 tokens: each request takes 2 s
    command = [sys.executable, str(SCRIPTS / "loadgen.py"), "--base-url", server.base_url]
    command += ["--num-prompts", "20", "--random-input-len", "4", "--random-output-len", "40"]
    command += ["--request-rate", "10", "--no-progress", "--ready-check-timeout-s", "0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert _wait(lambda: server.stats.num_requests >= 3)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=20)
    finally:
        kill_all([process.pid])
    assert process.returncode == 0, stderr
    assert "interrupted" in stderr and "Serving Benchmark Result" in stdout
    interrupted = int(stdout.split("Interrupted requests (Ctrl-C):")[1].split()[0])
    assert 1 <= interrupted <= server.stats.num_requests
    # The cancelled streams were really dropped: every stream the server started either
    # finished or saw the client hang up (a request cancelled before it arrived never started).
    stats = server.stats
    assert _wait(lambda: stats.num_active == 0)
    assert stats.num_disconnected >= 1
    assert stats.num_completed + stats.num_disconnected == stats.num_requests


def test_self_test_drives_its_own_server_and_stops_it(tmp_path, capsys):
    out = tmp_path / "self.json"
    assert loadgen.main(["--self-test", "--num-prompts", "40", "--result-json", str(out)]) == 0
    result = json.loads(out.read_text())
    for phase in result["self_test"].values():
        assert phase["failed"] == 0 and phase["request_throughput"] > 0
    assert "Load generator self-test" in capsys.readouterr().out
    assert not [pid for pid in descendants_named("loadgen_fake_server")]


def test_the_fake_server_exits_when_its_parent_dies():
    spawn = (
        "import subprocess, sys; "
        f"p = subprocess.Popen([sys.executable, {str(SCRIPTS / 'loadgen_fake_server.py')!r}], "
        "stdout=subprocess.PIPE, text=True); "
        "print(p.stdout.readline().strip(), p.pid, flush=True)"
    )
    parent = subprocess.run(
        [sys.executable, "-c", spawn], capture_output=True, text=True, timeout=30
    )
    port_line, pid = parent.stdout.split()
    assert port_line.startswith("PORT=")
    left = wait_until_gone([int(pid)], timeout_s=5.0)
    kill_all(left)
    assert not left


def descendants_named(fragment: str) -> list[int]:
    found = []
    for pid in descendants(os.getpid()):
        try:
            if fragment in Path(f"/proc/{pid}/cmdline").read_text():
                found.append(pid)
        except OSError:
            continue
    return found


def _wait(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()
