"""The metrics of several frontend processes merged into one scrape, without a server.

Each stand-in frontend is a process of its own (``tests.frontend.metrics_process``), as
prometheus_client's multiprocess mode is chosen per process when the library loads; they share
one folder as a server's frontends do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.frontend.server.metrics import token_count_buckets
from conveyor.frontend.server.metrics_dir import MULTIPROC_DIR_ENV, forget_process
from tests.frontend.http_helpers import metric, parse_metrics

ROOT = Path(__file__).resolve().parents[2]
OLDER = {"num_running": 5, "num_waiting": 4, "kv_cache_usage": 0.5, "num_preemptions": 2,
         "prefix_cache_queries": 100, "prefix_cache_hits": 40, "num_steps": 10,
         "num_prompt_tokens": 300, "num_generation_tokens": 50, "iteration_tokens": [4, 6]}  # fmt: skip
NEWER = {"num_running": 1, "num_waiting": 0, "kv_cache_usage": 0.125, "num_preemptions": 3,
         "prefix_cache_queries": 160, "prefix_cache_hits": 64, "num_steps": 15,
         "num_prompt_tokens": 310, "num_generation_tokens": 90, "iteration_tokens": [9, 6],
         "num_steps_timed": 12, "step_time_abs_error_s": 0.05, "step_time_s": 1.0,
         "num_steps_over_tbt_slo": 2, "spec_num_drafts": 20, "spec_num_draft_tokens": 70,
         "spec_num_accepted_tokens": 45, "spec_accepted_per_pos": [18, 12, 9, 6]}  # fmt: skip


def run_frontend(folder: Path, spec: dict) -> tuple[int, str]:
    """Run one stand-in frontend to the end; its pid and what it printed after that."""
    env = {**os.environ, MULTIPROC_DIR_ENV: str(folder)}
    process = subprocess.run(
        [sys.executable, "-m", "tests.frontend.metrics_process", json.dumps(spec)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    pid, _, printed = process.stdout.partition("\n")
    return int(pid), printed


def scrape(folder: Path) -> tuple[dict[str, float], str]:
    _, text = run_frontend(folder, {"render": True})
    return parse_metrics(text), text


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return tmp_path


def test_a_scrape_sums_every_frontends_requests(folder):
    run_frontend(folder, {"finished": [["length", 5, 3], ["length", 7, 2]], "in_flight": 2})
    run_frontend(folder, {"finished": [["stop", 11, 4]], "in_flight": 1})
    samples, text = scrape(folder)
    success = "conveyor:request_success_total"
    assert metric(samples, success, finished_reason="length") == 2
    assert metric(samples, success, finished_reason="stop") == 1
    assert metric(samples, success, finished_reason="abort") == 0
    assert metric(samples, "conveyor:prompt_tokens_total") == 5 + 7 + 11
    assert metric(samples, "conveyor:generation_tokens_total") == 3 + 2 + 4
    # Every choice's first token 0.1 s after arrival, then one every 0.1 s.
    ttft = "conveyor:time_to_first_token_seconds"
    assert metric(samples, ttft + "_count") == 3
    assert metric(samples, ttft + "_bucket", le="0.08") == 0
    assert metric(samples, ttft + "_bucket", le="0.25") == 3
    itl = "conveyor:inter_token_latency_seconds"
    assert metric(samples, itl + "_count") == 2 + 1 + 3
    assert metric(samples, itl + "_sum") == pytest.approx(0.6)
    assert metric(samples, "conveyor:request_queue_time_seconds_sum") == pytest.approx(0.75)
    assert metric(samples, "conveyor:request_inference_time_seconds_sum") == pytest.approx(4.5)
    assert metric(samples, "conveyor:request_prompt_tokens_bucket", le="10.0") == 2
    assert metric(samples, "conveyor:request_params_n_count") == 3
    # Requests in flight add up over the frontends that are alive.
    assert metric(samples, "conveyor:num_http_requests_in_flight") == 3
    assert "# TYPE conveyor:request_success_total counter" in text


def test_the_engines_counts_are_the_newest_copy_any_frontend_holds(folder):
    # One frontend published an older copy of the engine's stats, another a newer one; the
    # scrape must report the newer counts whichever frontend it reaches, and never their sum.
    run_frontend(folder, {"stats": NEWER})
    run_frontend(folder, {"stats": OLDER})
    samples, text = scrape(folder)
    assert metric(samples, "conveyor:num_preemptions_total") == 3
    assert metric(samples, "conveyor:prefix_cache_queries_total") == 160
    assert metric(samples, "conveyor:prefix_cache_hit_rate") == pytest.approx(0.4)
    assert "# TYPE conveyor:num_preemptions_total counter" in text
    # The step-cost model's record under a TBT SLO (zero in the older copy, as without one).
    assert metric(samples, "conveyor:step_time_predictions_total") == 12
    assert metric(samples, "conveyor:steps_over_tbt_slo_total") == 2
    assert metric(samples, "conveyor:step_time_prediction_error_ratio") == pytest.approx(0.05)
    # Speculative decoding: vLLM's spec_decode counters, per position labelled.
    assert metric(samples, "conveyor:spec_decode_num_drafts_total") == 20
    assert metric(samples, "conveyor:spec_decode_num_draft_tokens_total") == 70
    assert metric(samples, "conveyor:spec_decode_num_accepted_tokens_total") == 45
    per_pos = "conveyor:spec_decode_num_accepted_tokens_per_pos_total"
    assert [metric(samples, per_pos, position=str(i)) for i in range(4)] == [18, 12, 9, 6]
    # Tokens per step: one histogram (cumulative buckets, sum, count) of the newer copy.
    name = "conveyor:iteration_tokens_total"
    assert f"# TYPE {name} histogram" in text
    assert metric(samples, name + "_bucket", le="1.0") == 9
    assert metric(samples, name + "_bucket", le="8.0") == 15
    assert metric(samples, name + "_bucket", le="+Inf") == 15
    assert metric(samples, name + "_count") == 15
    assert metric(samples, name + "_sum") == 400
    # Gauges are the copy published last (here: the older one).
    assert metric(samples, "conveyor:num_requests_running") == 5
    assert metric(samples, "conveyor:kv_cache_usage_perc") == 0.5


def test_a_dead_frontends_live_gauges_go_and_its_counts_stay(folder):
    pid, _ = run_frontend(folder, {"finished": [["length", 5, 3]], "in_flight": 4})
    run_frontend(folder, {"in_flight": 1})
    samples, text = scrape(folder)
    assert metric(samples, "conveyor:num_http_requests_in_flight") == 5
    assert f'pid="{pid}"' in text
    forget_process(folder, pid)
    samples, text = scrape(folder)
    assert metric(samples, "conveyor:num_http_requests_in_flight") == 1
    assert metric(samples, "conveyor:request_success_total", finished_reason="length") == 1
    assert f'conveyor:frontend_info{{engine="0",model_name="m",pid="{pid}"}}' not in text


def test_token_count_buckets_follow_1_2_5_up_to_the_context():
    assert token_count_buckets(512) == [1, 2, 5, 10, 20, 50, 100, 200, 500]
    assert token_count_buckets(1000) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
