"""Row 2: mutated bodies and headers against a real server: no 5xx, no crash, memory flat.

One ``conveyor serve`` with an API key, a 64 KiB body limit and a 64-token context (so a
mutation that happens to be a valid request generates a few tokens, never thousands). Each request
goes over its own raw socket, so a mutation may break HTTP itself (bad header bytes, lying
Content-Length, a method the route does not take). Runs for CONVEYOR_FUZZ_SECONDS (default 4 s,
some thousands of requests); set it to 600 for a long run. The seed is printed on failure.
"""

from __future__ import annotations

import json
import os
import random
import socket
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.frontend.http_helpers import (
    ServedHttp,
    frontend_pids,
    post_json,
    rss_bytes,
    start_served_http,
)
from tests.process_tree import descendants

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("http-fuzz")]

API_KEY = "sk-fuzz"
FUZZ_SECONDS = float(os.environ.get("CONVEYOR_FUZZ_SECONDS", "4"))
# Alone on an idle 2-core machine 5 s of fuzzing sends about 4,000 requests; beside the rest of
# the suite (the other xdist worker starting servers) under 1,000. This only checks that the
# fuzzer ran at all, not how fast the server is (a benchmark's job).
MIN_REQUESTS = 400
NUM_THREADS = 8
MAX_RSS_GROWTH = 16 << 20
SEED_BODIES = [
    {"model": "tiny", "prompt": "def main():", "max_tokens": 2, "temperature": 0},
    {"prompt": [5, 6, 7], "max_tokens": 1, "n": 2, "seed": 3, "logprobs": 2, "stop": ["x"]},
    {"prompt": ["a", "b"], "max_tokens": 1, "stream": True, "stream_options": {"include_usage": 1}},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "top_logprobs": 1,
     "logprobs": True},
]  # fmt: skip
PATHS = ["/v1/completions", "/v1/completions", "/v1/chat/completions", "/v1/completions?x=1",
         "/v1//completions", "/v1/completions%00", "/v1/models", "/health", "/metrics", "/"]  # fmt: skip
METHODS = ["POST"] * 8 + ["GET", "PUT", "DELETE", "OPTIONS", "HEAD", "P\x00ST"]
JUNK = [b"null", b"1e309", b"-1", b"\"", b"{", b"}", b"[", b"]", b",", b":", b"\\u0000", b"\\ud800",
        b"99999999999999999999999", b"\xff\xfe", b"NaN", b"true", b"\x00", b" " * 100, b"\xc3"]  # fmt: skip
JSON_VALUES = [None, True, 0, -1, 1.5, 2**64, -(2**63), 1e308, "", "x" * 300, [], [1, "a"], {},
               {"role": "user"}, [[1, 2], [3]], [-5], "\ud7ff", float("inf")]  # fmt: skip


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedHttp]:
    log = tmp_path_factory.mktemp("fuzz") / "serve.log"
    extra = ["--api-key", API_KEY, "--max-request-body-bytes", str(64 << 10)]
    extra += ["--max-model-len", "64"]
    served = start_served_http(tiny_model_dir, log, extra)
    try:
        yield served
    finally:
        served.stop()


def _mutate_json(rng: random.Random, body: dict) -> bytes:
    body = dict(body)
    key = rng.choice([*body, "n", "max_tokens", "temperature", "top_p", "prompt", "logit_bias"])
    action = rng.random()
    if action < 0.2:
        body.pop(key, None)
    else:
        value = rng.choice(JSON_VALUES)
        body[key] = value if action < 0.9 else {"nested": [value] * rng.randint(1, 50)}
    return json.dumps(body, allow_nan=True).encode()


def _mutate_bytes(rng: random.Random, raw: bytes) -> bytes:
    data = bytearray(raw)
    for _ in range(rng.randint(1, 4)):
        where = rng.randrange(len(data) + 1)
        action = rng.randrange(5)
        if action == 0 and data:
            data[min(where, len(data) - 1)] = rng.randrange(256)
        elif action == 1:
            data[where:where] = rng.choice(JUNK)
        elif action == 2:
            del data[where : where + rng.randint(1, 8)]
        elif action == 3:
            data[where:where] = data[where : where + rng.randint(1, 64)] * rng.randint(2, 40)
        else:
            del data[where:]
    return bytes(data)


def _mutate_headers(rng: random.Random, headers: dict[str, bytes], body: bytes) -> list[bytes]:
    """Header lines; Content-Length may lie, but never above the body (that would just wait)."""
    headers = dict(headers)
    for _ in range(rng.randint(0, 3)):
        action = rng.randrange(8)
        if action == 0:
            headers.pop(rng.choice(list(headers)), None)
        elif action == 1:
            headers["Content-Type"] = rng.choice([b"text/plain", b"application/json; charset=utf-16",
                                                  b"multipart/form-data; boundary=x", b"\xff\xfe"])  # fmt: skip
        elif action == 2:
            headers["Authorization"] = rng.choice([b"Bearer ", b"Bearer " + API_KEY.encode() * 2,
                                                   b"bearer " + API_KEY.encode(), b"Bearer " + b"k" * 8000,
                                                   b"Basic " + API_KEY.encode(), b"Bearer \xff"])  # fmt: skip
        elif action == 3:
            headers["Content-Length"] = str(rng.randint(0, len(body))).encode()
        elif action == 4:
            name = rng.choice([b"X-Junk", b"x" * 300, b"Bad Name", b"", b"X-\x01"])
            headers[name.decode("latin-1")] = _mutate_bytes(rng, b"value")
        elif action == 5:
            headers["Transfer-Encoding"] = rng.choice([b"chunked", b"gzip", b"identity, chunked"])
        elif action == 6:
            headers["Expect"] = b"100-continue"
        else:
            headers["Connection"] = rng.choice([b"close", b"keep-alive", b"upgrade"])
    return [k.encode("latin-1") + b": " + v for k, v in headers.items()]


def _one_request(rng: random.Random) -> bytes:
    seed_body = rng.choice(SEED_BODIES)
    is_chat = "messages" in seed_body
    body = json.dumps(seed_body).encode()
    what = rng.random()
    if what < 0.45:
        body = _mutate_json(rng, seed_body)
    elif what < 0.95:
        body = _mutate_bytes(rng, body)
    path = "/v1/chat/completions" if is_chat else "/v1/completions"
    method = "POST"
    if rng.random() < 0.1:
        path, method = rng.choice(PATHS), rng.choice(METHODS)
    headers = {"Host": b"x", "Content-Type": b"application/json",
               "Authorization": b"Bearer " + API_KEY.encode(),
               "Content-Length": str(len(body)).encode()}  # fmt: skip
    lines = (
        _mutate_headers(rng, headers, body)
        if rng.random() < 0.5
        else [k.encode() + b": " + v for k, v in headers.items()]
    )
    if any(line.lower().startswith(b"transfer-encoding:") and b"chunked" in line for line in lines):
        # A chunked body ends at its last chunk: without one (a body cut to nothing, say) the
        # server rightly waits for more, like a Content-Length above the body would.
        body += b"0\r\n\r\n"
    head = f"{method} {path} HTTP/1.1".encode("latin-1")
    return b"\r\n".join([head, *lines]) + b"\r\n\r\n" + body


def _exchange(port: int, request: bytes) -> str:
    """The response's status code, or what happened instead ("closed", "timeout")."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            sock.sendall(request)
            response = b""
            while b"\r\n" not in response:
                data = sock.recv(4096)
                if not data:
                    return "closed"
                response += data
        except (ConnectionResetError, BrokenPipeError):
            return "closed"
        except TimeoutError:
            return "timeout"
    return response.split(b" ", 2)[1].decode()


def _fuzz(port: int, seed: int, seconds: float) -> Counter:
    """Mutated requests from NUM_THREADS clients at once (a request that is valid by chance
    generates tokens; meanwhile the others go on) until ``seconds`` pass; outcome counts."""
    outcomes: Counter[str] = Counter()
    failures: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + seconds

    def client(index: int) -> None:
        rng = random.Random(seed * NUM_THREADS + index)
        while time.monotonic() < deadline and not failures:
            request = _one_request(rng)
            outcome = _exchange(port, request)
            outcomes[outcome] += 1
            if outcome.startswith("5") or outcome == "timeout":
                failures.append((outcome, request[:600]))

    with ThreadPoolExecutor(NUM_THREADS) as pool:
        list(pool.map(client, range(NUM_THREADS)))
    assert not failures, f"seed {seed}: {failures[0]}"
    return outcomes


def test_mutated_bodies_and_headers_get_no_5xx_and_leave_the_server_as_it_was(served):
    seed = int(os.environ.get("CONVEYOR_FUZZ_SEED", random.randrange(1 << 30)))
    pids_before = sorted(descendants(served.process.pid))
    (frontend,) = frontend_pids(served.process.pid)
    # Warm up first: the first requests fill caches and the allocator's pools.
    warm = _fuzz(served.port, seed, max(1.0, FUZZ_SECONDS / 4))
    rss_start = rss_bytes(frontend)
    outcomes = _fuzz(served.port, seed + 1, FUZZ_SECONDS)
    rss_end = rss_bytes(frontend)
    total = sum(outcomes.values()) + sum(warm.values())
    summary = f"seed {seed}: {total} requests, outcomes {dict((outcomes + warm).most_common())}"
    print(summary)
    assert total >= MIN_REQUESTS * min(1.0, FUZZ_SECONDS / 4), summary
    assert outcomes["200"] > 0 and outcomes["400"] > 0, summary
    assert sorted(descendants(served.process.pid)) == pids_before, "a process died or was added"
    assert rss_end - rss_start < MAX_RSS_GROWTH, (
        f"the frontend grew from {rss_start >> 20} to {rss_end >> 20} MiB; {summary}"
    )
    # And it still serves exactly.
    good = {"prompt": "def main():", "max_tokens": 4, "temperature": 0}
    status, _, body = post_json(
        served.base_url, "/v1/completions", good, {"Authorization": f"Bearer {API_KEY}"}
    )
    assert status == 200 and body["usage"]["completion_tokens"] == 4, body
