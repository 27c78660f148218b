"""Data parallelism through the HTTP server: ``conveyor serve --data-parallel-size 2``.

Two servers, each of two engine cores behind one frontend: one on the ``bench`` model (the load
generator's requests all complete, both engines serve by their ``engine``-labelled metrics, and
greedy outputs equal one engine's, ``LLM`` in-process), and one on the tiny model that loses an
engine under load (row 22: the server keeps answering, requests that had streamed nothing are
sent to the other engine, none hangs, and the engine comes back and serves again).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from conveyor.frontend import LLM
from conveyor.protocol import SamplingParams
from tests.commands import CONVEYOR
from tests.frontend.http_helpers import (
    MODEL_NAME,
    ServedHttp,
    get,
    metric,
    parse_metrics,
    post_json,
    read_to_end,
    send_completion,
    start_served_http,
    stream_payloads,
    wait_for,
)

# One xdist group for the modules that start several engines, hosts or a Ray cluster each: run
# side by side on a 2-core machine they starve each other's (and the timing tests') heartbeats.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("multi-engine")]

GREEDY_PROMPTS = [f"def function_{i}(x):\n    return" for i in range(6)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def bench_model_dir() -> Path:
    from benchmarks.fixtures.model_maker import ensure_model

    return ensure_model("bench", "qwen3")


@pytest.fixture(scope="module")
def served_bench(bench_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    log = tmp_path_factory.mktemp("dp-bench") / "serve.log"
    extra = ["--data-parallel-size", "2", "--max-num-seqs", "8", "--router", "least-loaded"]
    served = start_served_http(bench_model_dir, log, [*extra, "--kv-cache-memory", "32M"])
    try:
        yield served
    finally:
        served.stop()


def _success(base_url: str, engine: str) -> float:
    samples = parse_metrics(get(base_url, "/metrics")[1])
    return metric(samples, "conveyor:request_success_total", engine=engine)


def test_both_engines_serve_the_load_generators_requests(served_bench, bench_model_dir, tmp_path):
    assert sorted(served_bench.dp_engine_pids) == [0, 1]
    result = tmp_path / "result.json"
    command = [*CONVEYOR, "bench", "serve", "--base-url", served_bench.base_url]
    command += ["--model", MODEL_NAME, "--tokenizer", str(bench_model_dir), "--no-progress"]
    command += ["--dataset-name", "random", "--random-input-len", "48", "--random-output-len", "8"]
    command += ["--num-prompts", "16", "--max-concurrency", "8", "--result-json", str(result)]
    subprocess.run(command, check=True, timeout=240, capture_output=True)
    report = json.loads(result.read_text())
    assert report["completed"] == 16 and report["failed"] == 0
    samples = parse_metrics(get(served_bench.base_url, "/metrics")[1])
    for engine in ("0", "1"):
        assert metric(samples, "conveyor:request_success_total", engine=engine) > 0
        assert metric(samples, "conveyor:iteration_tokens_total_count", engine=engine) > 0


def test_greedy_outputs_equal_one_engines(served_bench, bench_model_dir):
    body = {"model": MODEL_NAME, "temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}

    def complete(prompt: str) -> str:
        status, _, answer = post_json(
            served_bench.base_url, "/v1/completions", {**body, "prompt": prompt}
        )
        assert status == 200, answer
        return answer["choices"][0]["text"]

    # At once, so both engines take some (least-loaded spreads a burst).
    with concurrent.futures.ThreadPoolExecutor(len(GREEDY_PROMPTS)) as pool:
        served_texts = list(pool.map(complete, GREEDY_PROMPTS))
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(bench_model_dir), engine="inprocess", kv_cache_memory=32 << 20) as llm:
        outputs = llm.generate(GREEDY_PROMPTS, greedy, use_tqdm=False)
    assert served_texts == [output.outputs[0].text for output in outputs]


# ---------------------------------------------------------------- losing an engine under load

NUM_STREAMS = 16
LONG = 100
# A waiting request gets no byte until its first token: on a loaded machine the last of them
# waits for most of the others (the sockets' own timeout bounds a hang).
STREAM_TIMEOUT_S = 120.0


@pytest.fixture
def served_tiny(tiny_model_dir: Path, tmp_path: Path) -> Iterator[ServedHttp]:
    # Two running per engine, the rest waiting: an engine that dies holds both kinds.
    extra = ["--data-parallel-size", "2", "--max-num-seqs", "2", "--router", "least-loaded"]
    served = start_served_http(tiny_model_dir, tmp_path / "serve.log", extra)
    try:
        yield served
    finally:
        served.stop()


def _stream(base_url: str, index: int) -> str:
    """How one long streamed request ended: its finish reason, or "error" (an error event)."""
    body = {"model": MODEL_NAME, "prompt": f"{index} " * 6, "max_tokens": LONG}
    body.update(temperature=0, ignore_eos=True, stream=True)
    port = int(base_url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=STREAM_TIMEOUT_S)
    send_completion(base_url, body, sock=sock)
    try:
        payloads = stream_payloads(read_to_end(sock))
    finally:
        sock.close()
    if any("error" in payload for payload in payloads):
        return "error"
    reasons = [c["finish_reason"] for p in payloads for c in p["choices"] if c["finish_reason"]]
    return reasons[-1] if reasons else "none"


def test_a_dead_engine_is_restarted_while_the_other_serves(served_tiny):
    base_url, victim = served_tiny.base_url, served_tiny.dp_engine_pids[1]
    with concurrent.futures.ThreadPoolExecutor(NUM_STREAMS) as pool:
        streams = [pool.submit(_stream, base_url, i) for i in range(NUM_STREAMS)]
        # Once engine 1 has served a few steps: it has requests running and others waiting.
        assert wait_for(lambda: _steps_of_engine_1(base_url) > 0, 30.0)
        os.kill(victim, signal.SIGKILL)
        assert get(base_url, "/health")[0] == 200, "the other engine still serves"
        results = [stream.result(timeout=2 * STREAM_TIMEOUT_S) for stream in streams]  # none hangs
    # Only what engine 1 was running (two requests, which had streamed) fails; everything it
    # held waiting was sent to engine 0 and ran to the end there.
    assert results.count("error") <= 2
    assert results.count("length") == NUM_STREAMS - results.count("error")
    log = served_tiny.log
    assert wait_for(lambda: "sending it to another engine" in log.read_text(), 5.0)
    assert f"engine_core-1 (pid {victim}) exited with code -9; restarting it" in log.read_text()
    assert wait_for(lambda: "engine_core-1 serves again" in log.read_text(), 60.0)
    # The frontend attaches on its own (within a second of the engine serving).
    assert wait_for(lambda: "engine 1 serves again" in log.read_text(), 10.0)
    # Back in the rotation: a burst of new requests is shared with it again.
    before = _success(base_url, "1")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        endings = set(pool.map(lambda i: _stream(base_url, 100 + i), range(4)))
    assert endings == {"length"}
    assert wait_for(lambda: _success(base_url, "1") > before, 10.0)


def _steps_of_engine_1(base_url: str) -> float:
    samples = parse_metrics(get(base_url, "/metrics")[1])
    return metric(samples, "conveyor:iteration_tokens_total_count", engine="1")
