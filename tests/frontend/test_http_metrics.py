"""Observability through a real server with two frontends: merged metrics under the load
generator, the dashboard's queries, the engine's stats line, request logs, a quiet shutdown."""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conveyor.bench.loadgen import main as loadgen
from conveyor.frontend.server.request_log import MAX_LINE_BYTES
from conveyor.protocol.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from tests.frontend.http_helpers import (
    ServedHttp,
    accepting_frontend,
    frontend_pids,
    get,
    metric,
    parse_metrics,
    post_json,
    start_served_http,
    wait_for,
)

# On the worker of test_http_heavy, one after the other: this module's load generator would
# otherwise take the cores that module's /health latency budget is measured against.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("http-heavy")]

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "observability" / "grafana.json"
NUM_REQUESTS = 100
# Before its timed run the load generator checks the server is ready with one request of its
# own ("ready check", one output token): the server serves that one too.
PROBE_REQUESTS = PROBE_TOKENS = 1
STATS_LINE = re.compile(
    r"engine_core\[\d+\] INFO conveyor.engine_core.stats_logger: engine 0: prompt "
)


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedHttp]:
    log = tmp_path_factory.mktemp("metrics") / "serve.log"
    extra = ["--frontends", "2", "--stats-interval-s", "1", "--enable-log-requests"]
    served = start_served_http(tiny_model_dir, log, extra)
    try:
        yield served
    finally:
        served.stop()


@pytest.fixture(scope="module")
def load(served: ServedHttp, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """100 requests through the load generator; its result JSON."""
    out = tmp_path_factory.mktemp("load") / "result.json"
    argv = ["--base-url", served.base_url, "--num-prompts", str(NUM_REQUESTS)]
    argv += ["--random-input-len", "24", "--random-output-len", "24", "--random-range-ratio", "0.5"]
    argv += ["--request-rate", "inf", "--max-concurrency", "8", "--no-progress"]
    assert loadgen.main([*argv, "--result-json", str(out)]) == 0
    return json.loads(out.read_text())


def scrape(base_url: str) -> dict[str, float]:
    status, text = get(base_url, "/metrics")
    assert status == 200
    return parse_metrics(text)


def test_either_frontends_scrape_counts_the_whole_server(served, load):
    assert load["completed"] == NUM_REQUESTS and load["failed"] == 0
    pids = frontend_pids(served.process.pid)
    answered: set[int] = set()
    for _ in range(40):
        answered.add(accepting_frontend(served.port, pids))
        samples = scrape(served.base_url)
        num_served = NUM_REQUESTS + PROBE_REQUESTS
        assert metric(samples, "conveyor:request_success_total") == num_served
        assert metric(samples, "conveyor:request_success_total", finished_reason="length") == (
            num_served
        )
        generated = metric(samples, "conveyor:generation_tokens_total")
        assert generated == load["total_output_tokens"] + PROBE_TOKENS
        assert metric(samples, "conveyor:prompt_tokens_total") > load["total_input_tokens"]
        assert metric(samples, "conveyor:e2e_request_latency_seconds_count") == num_served
        assert metric(samples, "conveyor:request_queue_time_seconds_count") == num_served
        if len(answered) == 2:
            break
    assert answered == set(pids), "new connections reached both frontends"
    # The engine's own counts: every step's tokens, the prompts looked up in the prefix cache.
    samples = scrape(served.base_url)
    step_tokens = metric(samples, "conveyor:iteration_tokens_total_sum")
    assert step_tokens >= load["total_input_tokens"] + load["total_output_tokens"] - NUM_REQUESTS
    assert metric(samples, "conveyor:prefix_cache_queries_total") >= load["total_input_tokens"]
    assert metric(samples, "conveyor:num_requests_running") == 0

    def none_in_flight() -> bool:
        # The frontend that did not answer publishes its count at least once a second.
        return metric(scrape(served.base_url), "conveyor:num_http_requests_in_flight") == 0

    assert wait_for(none_in_flight, 5.0, 0.2)
    info = [key for key in samples if key.startswith("conveyor:frontend_info{")]
    assert len(info) == 2, info


def dashboard_metric_names() -> set[str]:
    """Every metric the dashboard's queries name (PromQL identifiers with our prefix)."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert len(exprs) >= 20
    return {name for expr in exprs for name in re.findall(r"conveyor:[a-z0-9_:]+", expr)}


def test_every_metric_the_dashboard_queries_is_served(served, load):
    names = dashboard_metric_names()
    assert len(names) >= 15
    served_names = {key.partition("{")[0] for key in scrape(served.base_url)}
    assert not names - served_names, f"the dashboard queries {sorted(names - served_names)}"


# The series vLLM's example Grafana dashboard queries (its 12 panels), as named by vLLM 0.11+.
VLLM_DASHBOARD = (
    "e2e_request_latency_seconds_bucket", "e2e_request_latency_seconds_sum",
    "e2e_request_latency_seconds_count", "prompt_tokens_total", "generation_tokens_total",
    "inter_token_latency_seconds_bucket", "inter_token_latency_seconds_sum",
    "inter_token_latency_seconds_count", "num_requests_running", "num_requests_waiting",
    "time_to_first_token_seconds_bucket", "time_to_first_token_seconds_sum",
    "time_to_first_token_seconds_count", "kv_cache_usage_perc", "request_prompt_tokens_bucket",
    "request_generation_tokens_bucket", "request_success_total",
    "request_queue_time_seconds_sum", "request_prefill_time_seconds_sum",
    "request_decode_time_seconds_sum", "request_max_num_generation_tokens_sum",
)  # fmt: skip


def test_vllms_dashboard_works_after_renaming_its_prefix(served, load):
    samples = scrape(served.base_url)
    for name in VLLM_DASHBOARD:
        # Labelled model_name as vLLM's are (its panels filter on it), with data after load.
        assert metric(samples, f"conveyor:{name}", model_name="tiny") >= 0, name
    assert metric(samples, "conveyor:request_queue_time_seconds_count") > 0


def test_requests_are_logged_at_arrival_and_at_the_end(served, load):
    log = served.log.read_text()
    arrivals = re.findall(r"INFO conveyor.frontend.requests: request (cmpl-\w+): 1 prompt\(s\) of \d+ tokens, "
                          r"params \{[^}]*'ignore_eos': True", log)  # fmt: skip
    ends = re.findall(r"INFO conveyor.frontend.requests: request (cmpl-\w+) finished: length, \d+ tokens "
                      r"generated, TTFT \d+\.\d+ s, E2E \d+\.\d+ s", log)  # fmt: skip
    num_served = NUM_REQUESTS + PROBE_REQUESTS
    assert len(arrivals) == len(ends) == num_served and set(arrivals) == set(ends)
    assert "prompts '" not in log, "prompts are logged only with --log-prompts"


def test_the_stats_line_runs_with_the_work_and_stops_when_idle(served, load):
    lines = STATS_LINE.findall(served.log.read_text())
    assert lines, "no stats line while the load ran"
    line = re.findall(r"engine 0: prompt [\d.]+ tok/s, generation [\d.]+ tok/s, running \d+, "
                      r"waiting \d+.*, preemptions \d+, KV cache [\d.]+ %, prefix cache hits "
                      r"[\d.]+ %", served.log.read_text())  # fmt: skip
    assert line
    # Idle now: at most the line for the interval the work ended in, then none.
    time.sleep(2.5)
    settled = len(STATS_LINE.findall(served.log.read_text()))
    time.sleep(3.0)
    assert len(STATS_LINE.findall(served.log.read_text())) == settled


def test_a_request_with_every_parameter_at_its_cap_logs_lines_within_8_kib(served):
    # Before the caps, one such request (with 400k-character stop strings) wrote a 6 MiB line.
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "n": 2,
        "allowed_token_ids": list(range(2048)) * 64,
        "stop": ["\u00e9" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
        "stop_token_ids": list(range(256)),
        "logit_bias": {str(i): 1.0 for i in range(300)},
        "structured_outputs": {"json": {"type": "object", "description": "x" * 200_000}},
    }
    status, _, answer = post_json(served.base_url, "/v1/chat/completions", body)
    assert status == 200, answer
    too_long = {**body, "stop": ["x" * 400_000]}
    status, _, answer = post_json(served.base_url, "/v1/chat/completions", too_long)
    assert (status, answer["error"]["param"]) == (400, "stop")
    lines = served.log.read_bytes().splitlines()
    assert max(len(line) for line in lines) <= MAX_LINE_BYTES
    (arrival,) = [line for line in lines if b"params {" in line and b"json_schema grammar" in line]
    assert b"...(131072 items)" in arrival and b"...(256 chars)" in arrival


def test_a_normal_shutdown_logs_no_error_or_warning(served, load):
    served.process.send_signal(signal.SIGTERM)
    assert served.process.wait(30.0) == 0
    problems = [line for line in served.log.read_text().splitlines()
                if " ERROR " in line or " WARNING " in line or "Traceback" in line]  # fmt: skip
    assert problems == []
