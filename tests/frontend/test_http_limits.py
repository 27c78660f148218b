"""Bad input, the API key, the in-flight cap and the body limit, against a real server.

One ``conveyor serve`` per module with one frontend, ``--api-key-file``, ``--max-queued-requests 2``
and a 64 KiB body limit. Every refusal must come back as an OpenAI error body of bounded size,
never a 5xx, and leave the engine serving exactly as before. The last test stops the supervisor
with SIGTERM, so it must stay last.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from conveyor.frontend.server.app import ServerSettings, build_app
from conveyor.frontend.server.gate import GateMiddleware
from tests.frontend.http_helpers import (
    MODEL_NAME,
    ServedHttp,
    get,
    metric,
    parse_metrics,
    post_json,
    post_raw,
    read_events,
    send_completion,
    start_served_http,
    wait_for,
)
from tests.process_tree import descendants, wait_until_gone

# One server per module: with --dist loadgroup, xdist keeps a module on one worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("http-limits")]

API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
BODY_LIMIT = 64 << 10
MAX_IN_FLIGHT = 2
MAX_ERROR_BYTES = 1024
GREEDY = {"model": MODEL_NAME, "prompt": "def main():", "max_tokens": 6, "temperature": 0}
CHAT_MESSAGES = [{"role": "user", "content": "hi"}]
LONG_STREAM = {"prompt": "x = 1", "max_tokens": 3000, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedHttp]:
    folder = tmp_path_factory.mktemp("limits")
    log, key_file = folder / "serve.log", folder / "api-key"
    key_file.write_text(API_KEY + "\n")
    extra = ["--api-key-file", str(key_file), "--max-queued-requests", str(MAX_IN_FLIGHT)]
    extra += ["--max-request-body-bytes", str(BODY_LIMIT)]
    served = start_served_http(tiny_model_dir, log, extra)
    try:
        yield served
    finally:
        served.stop()


def _greedy_tokens(base_url: str) -> tuple[list[str], str]:
    status, _, body = post_json(base_url, "/v1/completions", {**GREEDY, "logprobs": 0}, AUTH)
    assert status == 200, body
    choice = body["choices"][0]
    return choice["logprobs"]["tokens"], choice["text"]


@pytest.fixture(scope="module")
def baseline(served: ServedHttp) -> tuple[list[str], str]:
    """The greedy tokens of a normal request before any bad input reached this server."""
    return _greedy_tokens(served.base_url)


def _assert_error_body(status: int, raw: bytes, expected_status: int) -> dict:
    assert status == expected_status, raw[:300]
    assert len(raw) <= MAX_ERROR_BYTES, f"error body of {len(raw)} bytes"
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert isinstance(error["message"], str) and error["message"]
    return error


def _completion(**fields: object) -> dict:
    return {**GREEDY, **fields}


# (case id, path, body as bytes or JSON-able, expected status, expected param or None)
CASES = [
    ("bad-json", "/v1/completions", b'{"prompt": "x", ', 400, None),
    ("not-an-object", "/v1/completions", b"[1, 2, 3]", 400, None),
    ("deeply-nested-unknown-field", "/v1/completions",
     b'{"prompt": "x", "extra": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None),
    ("prompt-missing", "/v1/completions", {"max_tokens": 4}, 400, None),
    ("prompt-wrong-type", "/v1/completions", _completion(prompt=5), 400, "prompt"),
    ("prompt-mixed", "/v1/completions", _completion(prompt=[1, "a"]), 400, "prompt"),
    ("temperature-string", "/v1/completions", _completion(temperature="hot"), 400, "temperature"),
    ("max-tokens-float", "/v1/completions", _completion(max_tokens=1.5), 400, "max_tokens"),
    ("max-tokens-zero", "/v1/completions", _completion(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-negative", "/v1/completions", _completion(max_tokens=-3), 400, "max_tokens"),
    ("temperature-negative", "/v1/completions", _completion(temperature=-0.5), 400, "temperature"),
    ("top-p-zero", "/v1/completions", _completion(top_p=0.0), 400, "top_p"),
    ("top-p-above-one", "/v1/completions", _completion(top_p=1.5), 400, "top_p"),
    ("empty-prompt", "/v1/completions", _completion(prompt=""), 400, "prompt"),
    ("empty-prompt-list", "/v1/completions", _completion(prompt=[]), 400, "prompt"),
    ("token-above-vocab", "/v1/completions", _completion(prompt=[5, 2048]), 400, "prompt"),
    ("token-negative", "/v1/completions", _completion(prompt=[-1, 5]), 400, "prompt"),
    ("n-too-large", "/v1/completions", _completion(n=17), 400, "n"),
    ("n-zero", "/v1/completions", _completion(n=0), 400, "n"),
    ("prompt-plus-max-tokens-too-long", "/v1/completions", _completion(max_tokens=5000), 400,
     "max_tokens"),
    ("prompt-too-long", "/v1/completions", _completion(prompt=[5] * 4096), 400, "prompt"),
    ("seed-beyond-int64", "/v1/completions", _completion(seed=2**70), 400, "seed"),
    ("seed-plus-n-beyond-int64", "/v1/completions", _completion(seed=2**63 - 1, n=2), 400,
     "seed"),
    ("stop-token-outside-vocab", "/v1/completions", _completion(stop_token_ids=[9999]), 400,
     "stop_token_ids"),
    ("logprobs-too-many", "/v1/completions", _completion(logprobs=21), 400, "logprobs"),
    ("unknown-field", "/v1/completions", _completion(frobnicate=1), 400, "frobnicate"),
    ("unknown-model", "/v1/completions", _completion(model="gpt-9"), 404, "model"),
    ("huge-unknown-model", "/v1/completions", _completion(model="m" * 50_000), 404, "model"),
    ("chat-no-messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("chat-message-no-role", "/v1/chat/completions", {"messages": [{"content": "x"}]}, 400,
     None),
    ("chat-image-part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ("chat-top-logprobs-alone", "/v1/chat/completions",
     {"messages": CHAT_MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat-max-tokens-too-long", "/v1/chat/completions",
     {"messages": CHAT_MESSAGES, "max_tokens": 4096}, 400, "max_tokens"),
    ("chat-unknown-model", "/v1/chat/completions",
     {"messages": CHAT_MESSAGES, "model": "gpt-9"}, 404, "model"),
]  # fmt: skip


@pytest.mark.parametrize(
    "path, body, expected_status, expected_param", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_gets_an_openai_error_and_the_engine_keeps_serving(
    served, baseline, path, body, expected_status, expected_param
):
    raw_body = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, _, raw = post_raw(served.base_url, path, raw_body, AUTH)
    error = _assert_error_body(status, raw, expected_status)
    if expected_param is not None:
        assert error["param"] == expected_param, error
    assert _greedy_tokens(served.base_url) == baseline


ROUTES = [("GET", "/v1/models", 200), ("POST", "/v1/completions", 200),
          ("POST", "/v1/chat/completions", 200), ("GET", "/v1/nonexistent", 404),
          ("POST", "/tokenize", 200), ("POST", "/detokenize", 200),
          ("GET", "/v1/models/{model:path}", 200), ("POST", "/invocations", 200),
          ("GET", "/tokenizer_info", 200), ("POST", "/v1/responses", 200),
          ("GET", "/v1/responses/{response_id}", 404),
          ("POST", "/v1/responses/{response_id}/cancel", 404), ("POST", "/v1/messages", 200),
          ("POST", "/v1/messages/count_tokens", 200),
          # Without --enable-lora the run-time LoRA routes answer 404 (behind the key).
          ("POST", "/v1/load_lora_adapter", 404), ("POST", "/v1/unload_lora_adapter", 404)]  # fmt: skip
BODIES = {"/v1/completions": GREEDY, "/v1/chat/completions": {"messages": CHAT_MESSAGES,
                                                              "max_tokens": 2},
          "/tokenize": {"prompt": "x"}, "/detokenize": {"tokens": [1, 2]},
          "/invocations": GREEDY, "/v1/responses": {"input": "hi", "max_output_tokens": 2},
          "/v1/responses/resp_unknown/cancel": {},
          "/v1/messages": {"max_tokens": 2, "messages": CHAT_MESSAGES},
          "/v1/messages/count_tokens": {"messages": CHAT_MESSAGES},
          "/v1/load_lora_adapter": {"lora_name": "x", "lora_path": "/x"},
          "/v1/unload_lora_adapter": {"lora_name": "x"}}  # fmt: skip
# A route's path as the app lists it -> the path a request takes.
REQUEST_PATHS = {"/v1/models/{model:path}": f"/v1/models/{MODEL_NAME}",
                 "/v1/responses/{response_id}": "/v1/responses/resp_unknown",
                 "/v1/responses/{response_id}/cancel": "/v1/responses/resp_unknown/cancel"}  # fmt: skip
OPEN = {"/health", "/metrics", "/version", "/ping", "/load", "/openapi.json", "/docs"}


def _call(base_url: str, method: str, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
    path = REQUEST_PATHS.get(path, path)
    if method == "GET":
        status, text = get(base_url, path, headers)
        return status, text.encode()
    status, _, raw = post_json(base_url, path, BODIES[path], headers)
    return status, json.dumps(raw).encode()


def test_api_key_guards_every_route_but_the_probes_and_version(served):
    # Every API route the app has is in ROUTES: a new route cannot slip past this test.
    app_routes = {route.path for route in build_app(ServerSettings("ipc://unused")).routes}
    assert app_routes - {path for _, path, _ in ROUTES} == OPEN
    wrong_keys = [{}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": API_KEY},
                  {"Authorization": f"Basic {API_KEY}"}]  # fmt: skip
    for method, path, allowed_status in ROUTES:
        for headers in wrong_keys:
            status, raw = _call(served.base_url, method, path, headers)
            if path.startswith("/v1/messages"):  # Anthropic's routes, Anthropic's shape
                body = json.loads(raw)
                assert status == 401 and body["error"]["type"] == "authentication_error"
            else:
                _assert_error_body(status, raw, 401)
        assert _call(served.base_url, method, path, AUTH)[0] == allowed_status, path
    for path in OPEN:
        assert get(served.base_url, path)[0] == 200


def test_the_api_key_is_on_no_command_line_and_in_no_log(served):
    """Row 21, given the way the docs give it (a file): no process of the server shows the key
    in /proc/PID/cmdline (readable by every local user), and no log line holds it."""
    for pid in [served.process.pid, *descendants(served.process.pid)]:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        assert API_KEY.encode() not in cmdline, f"pid {pid}: {cmdline!r}"
    assert API_KEY not in served.log.read_text()


def _open_stream(base_url: str) -> socket.socket:
    sock = send_completion(base_url, LONG_STREAM, AUTH)
    assert read_events(sock, 1).startswith(b"HTTP/1.1 200")
    return sock


def test_requests_beyond_the_in_flight_cap_get_429_with_retry_after(served):
    streams = [_open_stream(served.base_url) for _ in range(MAX_IN_FLIGHT)]
    try:
        status, headers, raw = post_raw(
            served.base_url, "/v1/completions", b'{"prompt": "x"}', AUTH
        )
        error = _assert_error_body(status, raw, 429)
        assert error["type"] == "RateLimitError" and int(headers["retry-after"]) >= 1
        assert get(served.base_url, "/health")[0] == 200, "health is never rate limited"
        # The refusal came before the request was admitted: in flight is still exactly the cap.
        samples = parse_metrics(get(served.base_url, "/metrics")[1])
        assert metric(samples, "conveyor:num_http_requests_in_flight") == MAX_IN_FLIGHT
    finally:
        for sock in streams:
            sock.close()

    def served_again() -> bool:
        return post_json(served.base_url, "/v1/completions", GREEDY, AUTH)[0] == 200

    assert wait_for(served_again, 10.0, 0.1), "the cap did not free up after the streams closed"
    samples = parse_metrics(get(served.base_url, "/metrics")[1])
    assert metric(samples, "conveyor:http_responses_total", code="429") >= 1
    assert metric(samples, "conveyor:num_http_requests_in_flight") == 0


def _raw_exchange(base_url: str, head: bytes, chunks: list[bytes]) -> bytes:
    """Send a head and body chunks over one connection; the response's status line and headers."""
    port = int(base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        for chunk in chunks:
            sock.sendall(chunk)
        response = b""
        while b"\r\n\r\n" not in response:
            data = sock.recv(4096)
            if not data:
                break
            response += data
    return response


def test_a_body_over_the_limit_gets_413_before_it_is_read(served, baseline):
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY
    # A declared size over the limit is refused at once: the server never waits for the body.
    declared = _raw_exchange(
        served.base_url, f"{head}\r\nContent-Length: {10**9}\r\n\r\n".encode(), []
    )
    assert declared.startswith(b"HTTP/1.1 413"), declared[:200]

    # Without a declared size the count is kept while streaming in.
    chunk = b" " * 10_000
    chunked = [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * 8 + [b"0\r\n\r\n"]
    counted = _raw_exchange(
        served.base_url, f"{head}\r\nTransfer-Encoding: chunked\r\n\r\n".encode(), chunked
    )
    assert counted.startswith(b"HTTP/1.1 413"), counted[:200]

    status, _, raw = post_raw(served.base_url, "/v1/completions", b" " * (BODY_LIMIT + 1), AUTH)
    assert _assert_error_body(status, raw, 413)["type"] == "RequestTooLargeError"
    padded = json.dumps(GREEDY).encode().ljust(BODY_LIMIT)  # JSON allows trailing whitespace
    assert post_raw(served.base_url, "/v1/completions", padded, AUTH)[0] == 200
    assert _greedy_tokens(served.base_url) == baseline


def _num_responses(base_url: str, code: int) -> float:
    samples = parse_metrics(get(base_url, "/metrics")[1])
    name = "conveyor:http_responses_total"
    return sum(v for k, v in samples.items() if k.startswith(name) and f'code="{code}"' in k)


def test_a_client_hanging_up_mid_upload_is_counted_not_a_server_error(served, baseline):
    """The head promises 1000 bytes of body, 10 come, then the client hangs up: a client's
    close (499 in /metrics), not a 500 with tracebacks in the log."""
    log_before = len(served.log.read_text())
    num_closed = _num_responses(served.base_url, 499)
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += f"Authorization: Bearer {API_KEY}\r\nContent-Length: 1000\r\n\r\n"
    port = int(served.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head.encode() + b'{"prompt":')

    def counted() -> bool:
        return _num_responses(served.base_url, 499) == num_closed + 1

    assert wait_for(counted, 10.0, 0.1), "the hang-up was not counted as a client close"
    assert _num_responses(served.base_url, 500) == 0
    log = served.log.read_text()[log_before:]
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-2000:]
    assert get(served.base_url, "/health")[0] == 200
    assert _greedy_tokens(served.base_url) == baseline


def test_the_gate_counts_a_request_that_raised_once_as_a_500():
    """The 500 for an unexpected error is sent outside the gate; it must still be counted, and
    a response already started when the error came is not counted twice."""
    statuses: list[int] = []
    metrics = SimpleNamespace(observe_response=statuses.append)
    state = SimpleNamespace(
        metrics=metrics, client=SimpleNamespace(dead_reason=None), draining=False, num_in_flight=0
    )

    async def fails_before_answering(scope, receive, send) -> None:
        raise RuntimeError("a bug")

    async def fails_while_streaming(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("a bug")

    async def ignore(message) -> None:
        pass

    scope = {"type": "http", "path": "/v1/completions", "headers": []}
    for app in (fails_before_answering, fails_while_streaming):
        gate = GateMiddleware(app, lambda: state, api_keys=(), max_queued_requests=None)
        with pytest.raises(RuntimeError, match="a bug"):
            asyncio.run(gate(scope, ignore, ignore))
    assert sorted(statuses) == [200, 500]
    assert state.num_in_flight == 0


def test_sigterm_stops_the_supervisor_and_its_frontend_with_exit_zero(served):
    children = descendants(served.process.pid)
    assert len(children) >= 3, "engine core, worker and frontend"
    served.process.send_signal(signal.SIGTERM)
    assert served.process.wait(30.0) == 0
    assert wait_until_gone(children, 10.0) == []
