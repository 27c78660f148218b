"""Row 18: one request that is legal in size but heavy to process must not stall its frontend.

One ``conveyor serve`` with one frontend and a 3 s heartbeat timeout per module (so a frontend
whose heartbeats starve would be dropped within the test). While four greedy streams run on that
frontend, each heavy request is sent and timed, and ``/health`` is polled every 20 ms: the heavy
requests get their 400 within a second, ``/health`` answers within 100 ms (95 % of polls; every
one within a second: the engine's worker and the tokenizer threads keep both cores of a 2-core
machine busy meanwhile, and a poll now and then waits its turn for a core: 120-135 ms in some
runs alone, 516 ms once beside another server's tests; a stalled loop makes it seconds), the
four streams end with exactly the text they have alone, and the frontend is neither dropped nor
restarted.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conveyor.frontend.tokenizer import load_tokenizer
from tests.frontend.http_helpers import (
    MODEL_NAME,
    ServedHttp,
    frontend_pids,
    get,
    post_json,
    post_raw,
    send_completion,
    start_served_http,
    stream_text,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("http-heavy")]

# Long enough to outlast the heavy requests on a loaded 2-core machine (a stream that ends inside
# the window measures nothing there: see ``longest_gap_s``; alone or beside a busy process all
# four outlasted the 256-prompt request in 5 of 5 runs, 1.8-2.9 s, at 1,000 tokens; on a faster
# day 1 run of 4 had a stream end inside the window (the text request took 1.96 s), so 2,000).
STREAM_TOKENS = 2000
NUM_STREAMS = 4
HEALTH_BUDGET_S = 0.1  # for 95 % of the polls
HEALTH_LIMIT_S = 1.0  # for every poll
REFUSAL_BUDGET_S = 1.0
# The longest a running stream may wait for its next token while another request is prepared.
MAX_STREAM_GAP_S = 0.5
# ... while a heavy grammar is built beside it: the build takes seconds, and a stream it held
# would wait all of them; a loaded 2-core run once saw every stream wait 0.54 s alike (the
# machine, not the build), so the bound leaves room for that.
HEAVY_STREAM_GAP_S = 1.0
STREAM = {"model": MODEL_NAME, "prompt": "def main():", "max_tokens": STREAM_TOKENS,
          "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedHttp]:
    log = tmp_path_factory.mktemp("heavy") / "serve.log"
    # A 5 s step watchdog: a grammar built inside a step would trip it (row 24).
    extra = ["--frontends", "1", "--heartbeat-timeout-s", "3", "--step-timeout-s", "5"]
    served = start_served_http(tiny_model_dir, log, extra)
    try:
        yield served
    finally:
        served.stop()


@pytest.fixture(scope="module")
def reference(served: ServedHttp) -> str:
    """Choice 0's text for ``STREAM`` when nothing else runs."""
    status, _, body = post_json(served.base_url, "/v1/completions", {**STREAM, "stream": False})
    assert status == 200, body
    return body["choices"][0]["text"]


class HealthPoller:
    """GET /health every 5 ms from a thread; keeps the slowest answer and any failure."""

    def __init__(self, base_url: str) -> None:
        self._base_url = base_url
        self._stop = threading.Event()
        self.latencies_s: list[float] = []
        self.failures: list[str] = []
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10.0)

    def _poll(self) -> None:
        while not self._stop.wait(0.005):
            start = time.perf_counter()
            try:
                status, _ = get(self._base_url, "/health")
            except OSError as exc:
                self.failures.append(repr(exc))
                continue
            self.latencies_s.append(time.perf_counter() - start)
            if status != 200:
                self.failures.append(f"status {status}")


class TimedStream:
    """One stream read on its own thread, with the arrival time of every chunk."""

    def __init__(self, base_url: str) -> None:
        self.sock = send_completion(base_url, STREAM)
        self.raw = b""
        self.arrivals: list[float] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while b"data: [DONE]" not in self.raw:
            try:
                data = self.sock.recv(65536)
            except OSError:
                break
            if not data:
                break
            self.arrivals.append(time.perf_counter())
            self.raw += data

    def result(self) -> tuple[str, str | None]:
        self._thread.join(60.0)
        return stream_text(self.raw)

    def longest_gap_s(self, start: float, end: float) -> float | None:
        """The longest wait for a chunk within [start, end]; None if the stream ended inside
        it (the time after its end is no wait, and what came before is only part of one)."""
        if not self.arrivals or self.arrivals[-1] <= end:
            return None
        times = [start, *(t for t in self.arrivals if start < t < end), end]
        return max(b - a for a, b in zip(times, times[1:]))


def _while_streams_run(
    served: ServedHttp, reference: str, heavy: Callable[[], None]
) -> list[float | None]:
    """Start the streams, run ``heavy`` under the health poller, then check the streams.

    Returns each stream's longest wait for a chunk while ``heavy`` ran.
    """
    pids_before = frontend_pids(served.process.pid)
    streams = [TimedStream(served.base_url) for _ in range(NUM_STREAMS)]
    try:
        with HealthPoller(served.base_url) as health:
            # The streams are generating. Polled from now on: the heavy requests may all be
            # refused within a tenth of a second, too short a window for a p95 of its own, so
            # the poller first gets enough answers while the streams run (on a loaded machine
            # its thread may need far longer than 0.3 s for them).
            time.sleep(0.3)
            wait_for(lambda: len(health.latencies_s) > 10, 2.0, 0.02)
            start = time.perf_counter()
            heavy()
            end = time.perf_counter()
            results = [stream.result() for stream in streams]
    finally:
        for stream in streams:
            stream.sock.close()
    assert results == [(reference, "length")] * NUM_STREAMS
    assert not health.failures, health.failures[:5]
    latencies = sorted(health.latencies_s)
    p95, slowest = latencies[int(0.95 * (len(latencies) - 1))], latencies[-1]
    summary = (
        f"{len(latencies)} polls of /health: p95 {p95 * 1e3:.0f} ms, max {slowest * 1e3:.0f} ms"
    )
    assert len(latencies) > 10 and p95 < HEALTH_BUDGET_S and slowest < HEALTH_LIMIT_S, summary
    assert frontend_pids(served.process.pid) == pids_before, "the frontend was restarted"
    log = served.log.read_text()
    assert "silent for over" not in log and "exited with code" not in log
    return [s.longest_gap_s(start, end) for s in streams]


def _refused_in_time(served: ServedHttp, path: str, body: bytes, param: str) -> None:
    start = time.perf_counter()
    status, _, raw = post_raw(served.base_url, path, body)
    elapsed = time.perf_counter() - start
    assert status == 400, raw[:300]
    error = json.loads(raw)["error"]
    # Anthropic's shape has no param: its message names the field.
    assert error.get("param", param) == param and param in error["message"], error
    assert elapsed < REFUSAL_BUDGET_S, f"{path} {param}: refused after {elapsed:.2f} s"


def test_huge_prompts_and_chats_are_refused_at_once_and_other_streams_go_on(served, reference):
    text = json.dumps({"model": MODEL_NAME, "prompt": "x = 1 " * 1_250_000}).encode()
    strings = json.dumps({"model": MODEL_NAME, "prompt": ["a"] * 600_000}).encode()
    messages = [{"role": "user", "content": "a"}] * 240_000
    chat = json.dumps({"model": MODEL_NAME, "messages": messages}, separators=(",", ":"))
    assert len(text) > 7_500_000 and len(chat) < 8 << 20
    # The Responses API's input items: messages, and items that hold no role.
    items = json.dumps({"input": messages}, separators=(",", ":"))
    reasoning = json.dumps({"input": [{"type": "reasoning"}] * 300_000}, separators=(",", ":"))
    assert len(items) < 8 << 20 and len(reasoning) < 8 << 20
    # Anthropic's: messages, and one message of a great many blocks.
    anthropic = json.dumps({"max_tokens": 4, "messages": messages}, separators=(",", ":"))
    one = {"role": "user", "content": [{"type": "text", "text": ""}] * 280_000}
    blocks = json.dumps({"max_tokens": 4, "messages": [one]}, separators=(",", ":"))
    assert len(blocks) < 8 << 20

    def heavy() -> None:
        _refused_in_time(served, "/v1/completions", text, "prompt")
        _refused_in_time(served, "/v1/completions", strings, "prompt")
        _refused_in_time(served, "/v1/chat/completions", chat.encode(), "messages")
        _refused_in_time(served, "/v1/responses", items.encode(), "input")
        _refused_in_time(served, "/v1/responses", reasoning.encode(), "input")
        _refused_in_time(served, "/v1/messages", anthropic.encode(), "messages")
        _refused_in_time(served, "/v1/messages", blocks.encode(), "messages")

    _while_streams_run(served, reference, heavy)


def test_a_prompt_that_tokenizes_for_seconds_stalls_nothing_else(served, reference):
    """Prompts each short enough to pass the character bound, together megabytes of text to
    tokenize: the tokenizer runs off the event loop, so the streams and /health do not wait for
    it, and the heartbeats go on (the engine would drop a silent frontend after 3 s)."""
    prompts = ["def f(x):\n    return x + 1\n" * 20_000] * 12  # 6.7 MB, each 560 k characters
    body = json.dumps({"model": MODEL_NAME, "prompt": prompts, "max_tokens": 4}).encode()
    took: list[float] = []

    def heavy() -> None:
        start = time.perf_counter()
        status, _, raw = post_raw(served.base_url, "/v1/completions", body)
        took.append(time.perf_counter() - start)
        # Tokenized, each prompt is far longer than the context: refused, but only by counting.
        assert status == 400 and b"max_model_len" in raw, raw[:300]

    _while_streams_run(served, reference, heavy)
    assert took[0] > 0.5, f"tokenizing 6.7 MB took only {took[0]:.2f} s: not a heavy request"


def test_an_accepted_request_that_tokenizes_for_seconds_leaves_other_streams_running(
    served, reference, tiny_model_dir
):
    """256 prompts each just inside the context (together about a million tokens, seconds of
    tokenizing) are served, while the four streams keep getting tokens.

    What the streams wait for is compared with a control: the same prompts sent as token ids,
    which the frontend need not tokenize, so the engine's share of the request (admitting 256
    prompts of 3,630 tokens) is the same in both, and the text request's extra time is the
    frontend's tokenizing under whatever else the machine runs at that moment. A tokenizer on the
    event loop would hold every stream for all of that extra time; off the loop, the streams
    share the CPU with the tokenizer and wait at most half of it (or twice the control's longest
    wait, or ``MAX_STREAM_GAP_S``, whichever is more).
    """
    prompt = "def f(x):\n    return x + 1\n" * 330
    token_ids = list(load_tokenizer(tiny_model_dir)(prompt).input_ids)
    common = {"model": MODEL_NAME, "max_tokens": 1, "temperature": 0}
    bodies = {
        "control": json.dumps({**common, "prompt": [token_ids] * 256}).encode(),
        "text": json.dumps({**common, "prompt": [prompt] * 256}).encode(),
    }
    # The host's speed varies by the moment: a pair whose tokenizing ran too fast to tell a
    # stall from the CPU's sharing (see below) is run again, up to three times.
    for _ in range(3):
        took, gaps = _text_and_control(served, reference, bodies, len(token_ids))
        # In the server the tokenizing shares the CPU with the engine and the streams, so what
        # it cost there is the text request's extra time over the control (a loaded CI run: 1.1 s
        # timed alone, 2.2 s extra in the server, streams waiting 0.71 s; a fast host: 0.53 s
        # alone, 1.24 s extra; once, in a loaded suite, 0.49 s extra). A tokenizer on the event
        # loop holds every stream for about all of that extra time, so the test can tell only if
        # that time is above the bound's floor.
        tokenizing_s = took["text"] - took["control"]
        floor = max(MAX_STREAM_GAP_S, 2 * max(gaps["control"]))
        if tokenizing_s > floor:
            break
    assert tokenizing_s > floor, (
        f"tokenizing took {tokenizing_s:.2f} s in the server, too little for a stall of the "
        f"streams to show above {floor:.2f} s ({took})"
    )
    bound = max(floor, 0.5 * tokenizing_s)
    assert max(gaps["text"]) < bound, (
        f"requests took {took}; longest waits {gaps}; bound {bound:.2f} s"
    )


def _text_and_control(
    served: ServedHttp, reference: str, bodies: dict[str, bytes], prompt_len: int
) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Each body sent beside the streams: how long it took, and the streams' measured waits."""
    took: dict[str, float] = {}
    answers: dict[str, dict] = {}
    gaps: dict[str, list[float | None]] = {}
    for name, raw in bodies.items():

        def heavy(name: str = name, raw: bytes = raw) -> None:
            start = time.perf_counter()
            status, _, response = post_raw(served.base_url, "/v1/completions", raw)
            took[name] = time.perf_counter() - start
            assert status == 200, response[:300]
            answers[name] = json.loads(response)

        gaps[name] = _while_streams_run(served, reference, heavy)
    texts = {name: [c["text"] for c in answer["choices"]] for name, answer in answers.items()}
    assert texts["text"] == texts["control"] and len(set(texts["text"])) == 1
    assert len(texts["text"]) == 256
    num_prompt_tokens = answers["text"]["usage"]["prompt_tokens"]
    assert num_prompt_tokens == 256 * prompt_len > 900_000
    measured = {name: [g for g in gap if g is not None] for name, gap in gaps.items()}
    assert measured["text"] and measured["control"], (
        f"the streams ended before the heavy requests did: nothing measured ({took})"
    )
    return took, measured


def test_heavy_constraints_are_refused_at_once_or_served_without_holding_the_streams(
    served, reference
):
    """Row 24: a 40,000-string choice list and a 1 MB regex (n=16) are 400s within a second; a
    3,000-property JSON schema with n=16 is served while the streams go on (its matcher is built
    once, on the worker's grammar thread, and the request waits for it outside the steps), and
    the engine is never declared hung under a 5 s step watchdog. The same schema with every
    property optional costs seconds to build and fails at its second token (a grammar row over
    llguidance's limit): a 400 naming that, after the build, and the streams never wait for it."""
    common = {"model": MODEL_NAME, "prompt": "{", "max_tokens": 16, "n": 16, "temperature": 1}
    choice = {**common, "structured_outputs": {"choice": [f"item {i}" for i in range(40_000)]}}
    pattern = "(" + "|".join(f"w{i}" for i in range(150_000)) + ")"
    regex = {**common, "structured_outputs": {"regex": pattern}}
    properties = {f"p{i}": {"type": "integer"} for i in range(3000)}
    schema = {"type": "object", "properties": properties, "additionalProperties": False}
    # All required: one way through, served. All optional: after "{" a grammar row of ~12,000
    # items, over llguidance's limit: the request fails then, a 400, not a quiet "stop".
    wide = {**common, "structured_outputs": {"json": {**schema, "required": list(properties)}}}
    optional = {**common, "structured_outputs": {"json": schema}}
    answers: list[dict] = []
    took: list[float] = []

    def heavy() -> None:
        body = json.dumps(choice).encode()
        _refused_in_time(served, "/v1/completions", body, "structured_outputs")
        body = json.dumps(regex).encode()
        _refused_in_time(served, "/v1/completions", body, "structured_outputs")
        status, _, answer = post_json(served.base_url, "/v1/completions", wide)
        assert status == 200, answer
        answers.append(answer)

    def failing() -> None:
        start = time.perf_counter()
        status, _, body = post_json(served.base_url, "/v1/completions", optional)
        took.append(time.perf_counter() - start)
        assert status == 400 and "Current row has" in body["error"]["message"], body

    gaps = _while_streams_run(served, reference, heavy)
    texts = [c["text"] for c in answers[0]["choices"]]
    assert len(texts) == 16 and all(t.startswith("{") for t in texts), texts
    measured = [g for g in gaps if g is not None]
    assert measured, "the streams ended before the heavy requests did: nothing measured"
    assert max(measured) < HEAVY_STREAM_GAP_S, f"longest waits {gaps}"
    # Seconds of building on a loaded machine: the streams may end before it does (then what
    # is checked is that they end with their exact text); where they outlast it, it held none.
    gaps = _while_streams_run(served, reference, failing)
    assert max((g for g in gaps if g is not None), default=0.0) < HEAVY_STREAM_GAP_S, gaps
    assert took[0] < 15.0, f"the failing schema took {took[0]:.2f} s"
    assert "hung" not in served.log.read_text()
