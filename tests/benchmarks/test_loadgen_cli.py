"""conveyor bench serve end to end: result JSON, plot, capacity search, Ctrl-C, self-test, cleanup."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from conveyor.bench.loadgen import main as loadgen
from conveyor.bench.loadgen.capacity import CapacitySpec, make_probe, search_capacity
from conveyor.bench.loadgen.fake_server import FakeServer, FakeServerConfig
from tests.commands import CONVEYOR
from tests.frontend.http_helpers import free_port
from tests.process_tree import descendants, kill_all, wait_until_gone

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


def test_plot_without_matplotlib_is_refused_before_anything_is_sent(
    fake_server, monkeypatch, capsys
):
    server = fake_server(itl_ms=1)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    argv = ["--base-url", server.base_url, "--num-prompts", "2", "--plot", "out.png"]
    with pytest.raises(SystemExit) as exited:
        loadgen.main(argv)
    assert exited.value.code == 2
    assert "pip install matplotlib" in capsys.readouterr().err
    assert server.stats.num_requests == 0


def test_a_plot_that_fails_keeps_the_results(fake_server, tmp_path, capsys):
    server = fake_server(itl_ms=1)
    out = tmp_path / "result.json"
    argv = ["--base-url", server.base_url, "--num-prompts", "3", "--no-progress"]
    argv += ["--random-input-len", "8", "--random-output-len", "4"]
    png = tmp_path / "no-such-folder" / "plot.png"  # fails only once the run is over
    argv += ["--result-json", str(out), "--plot", str(png)]
    assert loadgen.main(argv) == 1
    captured = capsys.readouterr()
    assert "Serving Benchmark Result" in captured.out
    assert f"error: --plot {png}" in captured.err and str(out) in captured.err
    assert json.loads(out.read_text())["completed"] == 3


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


def test_a_median_ttft_bound_breaks_a_probe_that_only_queues():
    # A policy that queues keeps TBT low at any rate while TTFT grows: only the TTFT bound
    # sees that the server is past its capacity.
    queued = {"failed": 0, "completed": 20, "p99_itl_ms": 10.0, "median_ttft_ms": 5000.0}
    queued |= {"request_throughput": 4.0, "output_throughput": 0.0, "mean_e2el_ms": 0.0}
    unbounded = CapacitySpec(slo_itl_p99_ms=50.0)
    bounded = CapacitySpec(slo_itl_p99_ms=50.0, slo_ttft_median_ms=2000.0)
    assert make_probe(8.0, queued, unbounded).holds
    assert not make_probe(8.0, queued, bounded).holds
    assert make_probe(8.0, {**queued, "median_ttft_ms": 2000.0}, bounded).holds
    assert "median TTFT   5000.00 ms" in make_probe(8.0, queued, bounded).line(1)

    async def probe(rate: float) -> dict[str, float]:
        # Past 10 req/s requests wait: TTFT grows with the rate, TBT does not.
        ttft = 100.0 if rate <= 10.0 else 100.0 + 1000.0 * (rate - 10.0)
        served = {"request_throughput": min(rate, 10.0), "failed": 0, "completed": 20}
        return {"p99_itl_ms": 10.0, "median_ttft_ms": ttft, **served}

    lines: list[str] = []
    spec = CapacitySpec(50.0, slo_ttft_median_ms=2000.0, max_rate=64.0, tolerance=0.02)
    found = asyncio.run(search_capacity(_with_output(probe), spec, lines.append))
    assert 11.9 * 0.98 <= found.capacity <= 11.9 and not found.is_lower_bound
    assert found.as_dict()["capacity_probes"][0]["median_ttft_ms"] == 100.0
    unbounded_search = replace(spec, slo_ttft_median_ms=None)
    found = asyncio.run(search_capacity(_with_output(probe), unbounded_search, lines.append))
    assert found.capacity == 64.0 and found.is_lower_bound


def _with_output(probe):
    async def wrapped(rate: float) -> dict[str, float]:
        defaults = {"output_throughput": 0.0, "mean_e2el_ms": 0.0, "median_ttft_ms": 0.0}
        return {**defaults, **await probe(rate)}

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
    broke = min(p["request_rate"] for p in probes if not p["holds"])
    threshold = 4 / (held["mean_e2el_ms"] / 1000)
    assert 30 <= threshold <= 90  # 4 / 45 ms at best; a busy machine stretches the sleeps
    # The answer is the highest rate that held, below every rate that broke, and never above
    # what the server can do. (How far below depends on the machine: a probe that a burst of
    # other work slows breaks the SLO at a lower rate, which the search must believe.)
    assert result["capacity_request_rate"] == held["request_rate"] < broke
    assert result["capacity_request_rate"] <= 1.1 * threshold
    assert "serving capacity:" in capsys.readouterr().out


@pytest.mark.slow
def test_a_ttft_bound_finds_the_capacity_of_a_server_that_queues(fake_server_process, tmp_path):
    # Two streams generate at once, each 10 tokens 5 ms apart (about 45 ms plus what the
    # machine adds): about 40 req/s is all it serves, and past that requests queue. TBT stays
    # 5 ms at any rate, so the TBT SLO alone calls every rate fine; a median TTFT bound of
    # 100 ms finds the knee. (The SLOs sit far from what the machine adds, so a busy machine
    # moves the knee but not the verdicts.)
    base_url = fake_server_process("--itl-ms", "5", "--max-running", "2")
    argv = ["--base-url", base_url, "--num-prompts", "40", "--random-input-len", "8"]
    argv += ["--random-output-len", "10", "--burstiness", "inf", "--capacity-search"]
    argv += ["--slo-tbt-p99-ms", "50", "--no-progress", "--ready-check-timeout-s", "10"]
    tbt_only, bounded = tmp_path / "tbt_only.json", tmp_path / "bounded.json"
    rates = ["--capacity-start-rate", "40", "--capacity-max-rate", "80"]
    assert loadgen.main([*argv, *rates, "--result-json", str(tbt_only)]) == 0
    result = json.loads(tbt_only.read_text())
    assert result["capacity_request_rate"] == 80.0 and result["capacity_is_lower_bound"]
    assert result["slo_ttft_median_ms"] is None
    assert result["capacity_probes"][-1]["median_ttft_ms"] > 100  # at 80 req/s requests waited
    argv += ["--slo-ttft-median-ms", "100", "--capacity-start-rate", "20"]
    argv += ["--capacity-max-probes", "5", "--result-json", str(bounded)]
    assert loadgen.main(argv) == 0
    result = json.loads(bounded.read_text())
    assert result["slo_ttft_median_ms"] == 100.0 and not result["capacity_is_lower_bound"]
    assert 5 <= result["capacity_request_rate"] <= 70
    broke = [p for p in result["capacity_probes"] if not p["holds"]]
    assert broke and all(p["p99_itl_ms"] <= 50 and p["median_ttft_ms"] > 100 for p in broke)


def test_slow_probes_send_for_longer_to_reach_the_minimum_request_count(fake_server, tmp_path):
    # --duration 0.5 s sends 1 request at 2 req/s: a p99 of one request's gaps says little.
    # With --capacity-min-requests 4 the slow probes send on until they sent 4; the fast ones,
    # which send 4 within the duration, stop at it.
    out = tmp_path / "capacity.json"
    server = fake_server(itl_ms=1)
    argv = ["--base-url", server.base_url, "--num-prompts", "8", "--random-input-len", "4"]
    argv += ["--random-output-len", "3", "--burstiness", "inf", "--capacity-search"]
    argv += ["--slo-tbt-p99-ms", "1000", "--capacity-start-rate", "2", "--no-progress"]
    argv += ["--capacity-max-rate", "16", "--duration", "0.5", "--result-json", str(out)]
    assert loadgen.main([*argv, "--capacity-min-requests", "4"]) == 0
    probes = {p["request_rate"]: p for p in json.loads(out.read_text())["capacity_probes"]}
    assert set(probes) == {2.0, 4.0, 8.0, 16.0}
    # 0.5 s x 16 req/s sends 8 (and the 8 prompts cap it); 0.5 s x 8 sends 4.
    assert [probes[r]["completed"] for r in (2.0, 4.0, 8.0, 16.0)] == [4, 4, 4, 8]
    assert loadgen.main(argv) == 0  # without the minimum: the duration alone
    probes = {p["request_rate"]: p for p in json.loads(out.read_text())["capacity_probes"]}
    assert [probes[r]["completed"] for r in (2.0, 4.0, 8.0, 16.0)] == [1, 2, 4, 8]
    # Poisson arrivals (seeded): exactly the minimum, not the minimum in expectation.
    poisson = [a for a in argv if a not in ("--burstiness", "inf")]
    poisson[poisson.index("--capacity-max-rate") + 1] = "2"
    assert loadgen.main([*poisson, "--capacity-min-requests", "6"]) == 0
    assert [p["completed"] for p in json.loads(out.read_text())["capacity_probes"]] == [6]


def test_the_model_is_asked_again_while_the_server_starts(tmp_path):
    # GET /v1/models comes before the ready check: a server that listens a second late is
    # asked again (with backoff) rather than failing the run.
    port = free_port()
    server = LateServer(port, delay_s=1.0)
    out = tmp_path / "late.json"
    argv = ["--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "2"]
    argv += ["--random-input-len", "4", "--random-output-len", "2", "--no-progress"]
    try:
        assert (
            loadgen.main([*argv, "--ready-check-timeout-s", "20", "--result-json", str(out)]) == 0
        )
    finally:
        server.stop()
    assert json.loads(out.read_text())["model_id"] == "fake-model"


def test_asking_for_the_model_gives_up_with_a_clear_message(fake_server, capsys):
    argv = ["--num-prompts", "1", "--no-progress", "--ready-check-timeout-s"]
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    assert loadgen.main(["--base-url", url, *argv, "1"]) == 1
    assert 1.0 <= time.monotonic() - started < 8.0
    error = capsys.readouterr().err
    assert f"GET {url}/v1/models gave no model within --ready-check-timeout-s 1" in error
    assert "pass --model NAME" in error
    # A 4xx will not change by waiting: it ends the run at once.
    wrong_path = fake_server().base_url + "/nowhere"
    started = time.monotonic()
    assert loadgen.main(["--base-url", wrong_path, *argv, "30"]) == 1
    assert time.monotonic() - started < 5.0
    assert "HTTP 404" in capsys.readouterr().err


class LateServer:
    """A fake server that starts listening on ``port`` only ``delay_s`` after it is made."""

    def __init__(self, port: int, delay_s: float) -> None:
        self.server = FakeServer(FakeServerConfig())
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, args=(port, delay_s), daemon=True)
        self.thread.start()

    def _serve(self, port: int, delay_s: float) -> None:
        self.loop.run_until_complete(asyncio.sleep(delay_s))
        self.loop.run_until_complete(self.server.start(port=port))
        self.loop.run_forever()

    def stop(self) -> None:
        if self.loop.is_running():
            asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(timeout=10)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


def test_ctrl_c_stops_and_still_reports(fake_server):
    server = fake_server(itl_ms=50)  # 40 tokens: each request takes 2 s
    command = [*CONVEYOR, "bench", "serve", "--base-url", server.base_url]
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
    completed = int(stdout.split("Successful requests:")[1].split()[0])
    assert interrupted >= 1 and completed + interrupted <= 20
    # Every request the server saw was completed or interrupted by the client. Not the other
    # way round: a request still connecting when Ctrl-C came is interrupted before it arrives.
    assert server.stats.num_requests <= completed + interrupted
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
    assert not [pid for pid in descendants_named("fake_server")]


def test_the_fake_server_exits_when_its_parent_dies():
    spawn = (
        "import subprocess, sys; "
        "p = subprocess.Popen([sys.executable, '-m', 'conveyor.bench.loadgen.fake_server'], "
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
