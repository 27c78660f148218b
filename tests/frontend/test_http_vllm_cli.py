"""``conveyor serve`` started with a command line from vLLM's tool-calling documentation, plus
vLLM's TLS, CORS, several API keys, a root path, X-Request-Id headers and --max-logprobs: every
served name answers, and the port is this server's alone.

One server per module: ``-tp 1 --max-model-len 4k --served-model-name main alias
--enable-auto-tool-choice --tool-call-parser hermes --trust-remote-code --uvicorn-log-level
info``, over HTTPS with a self-signed certificate made here (the ``openssl`` binary), talked to
through the official ``openai`` client (which checks the certificate) and ``http.client``. The
port tests start second servers that must stop before their engine starts.
"""

from __future__ import annotations

import http.client
import json
import shlex
import shutil
import socket
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.frontend.http_helpers import (
    ServedHttp,
    assert_refused_before_the_model_loads,
    free_port,
    start_served_http,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("http-vllm-cli")]

# As vLLM's docs write it (after `vllm serve MODEL`).
VLLM_COMMAND_LINE = shlex.split(
    "-tp 1 --max-model-len 4k --served-model-name main alias --enable-auto-tool-choice "
    "--tool-call-parser hermes --trust-remote-code --uvicorn-log-level info"
)
KEYS = ("sk-first", "sk-second")
ORIGIN = "https://chat.example.com"
ROOT_PATH = "/llm"
PROMPT = "def main():"
MAX_LOGPROBS = 30


def make_certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl binary to make a certificate with")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        + ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return key, cert


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_certificate(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def served(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, certificate: tuple[Path, Path]
) -> Iterator[ServedHttp]:
    key, cert = certificate
    extra = [*VLLM_COMMAND_LINE, "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)]
    extra += ["--allowed-origins", json.dumps([ORIGIN]), "--allow-credentials"]
    extra += ["--api-key", *KEYS, "--root-path", ROOT_PATH, "--enable-request-id-headers"]
    extra += ["--max-logprobs", str(MAX_LOGPROBS)]
    log = tmp_path_factory.mktemp("http-vllm-cli") / "serve.log"
    served = start_served_http(tiny_model_dir, log, extra)
    try:
        yield served
    finally:
        served.stop()


@pytest.fixture(scope="module")
def tls(certificate: tuple[Path, Path]) -> ssl.SSLContext:
    """A client context that trusts the self-signed certificate, and checks it."""
    return ssl.create_default_context(cafile=str(certificate[1]))


@pytest.fixture(scope="module")
def client(served: ServedHttp, tls: ssl.SSLContext) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{served.base_url}/v1",
        api_key=KEYS[1],
        max_retries=0,
        http_client=openai.DefaultHttpx2Client(verify=tls),
    )


def request(
    served: ServedHttp,
    tls: ssl.SSLContext,
    method: str,
    path: str,
    headers: dict[str, str] | None = None,
    body: object = None,
) -> tuple[int, dict[str, str], bytes]:
    """One HTTPS request; response header names lower-cased."""
    connection = http.client.HTTPSConnection("127.0.0.1", served.port, timeout=30, context=tls)
    try:
        data = None if body is None else json.dumps(body).encode()
        connection.request(method, path, body=data, headers=headers or {})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def test_it_serves_https_and_says_so(served):
    assert served.base_url == f"https://127.0.0.1:{served.port}"
    connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
    with pytest.raises((http.client.HTTPException, OSError)):
        connection.request("GET", "/health")
        connection.getresponse()
    connection.close()


def test_every_served_name_is_listed_and_answers(client):
    assert [model.id for model in client.models.list().data] == ["main", "alias"]
    texts = []
    for name in ("main", "alias"):
        completion = client.completions.create(
            model=name, prompt=PROMPT, max_tokens=8, temperature=0
        )
        assert completion.model == "main", "responses carry the first name"
        texts.append(completion.choices[0].text)
        chat = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert chat.model == "main" and chat.choices[0].finish_reason == "length"
    assert texts[0] == texts[1], "one model under two names"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)


def test_max_logprobs_raises_the_cap(client):
    completion = client.completions.create(
        model="main", prompt=PROMPT, max_tokens=2, logprobs=MAX_LOGPROBS, temperature=0
    )
    assert all(len(top) == MAX_LOGPROBS for top in completion.choices[0].logprobs.top_logprobs)
    with pytest.raises(openai.BadRequestError, match="between 0 and 30"):
        client.completions.create(model="main", prompt=PROMPT, max_tokens=2, logprobs=31)


def test_auto_tool_choice_is_on(client):
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
    chat = client.chat.completions.create(
        model="alias",
        messages=[{"role": "user", "content": "what time is it?"}],
        tools=[tool],
        tool_choice="auto",
        max_tokens=8,
    )
    assert chat.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_any_of_the_api_keys_and_no_other(served, tls):
    for key in KEYS:
        status, _, _ = request(served, tls, "GET", "/v1/models", {"Authorization": f"Bearer {key}"})
        assert status == 200
    for headers in ({}, {"Authorization": "Bearer sk-third"}, {"Authorization": KEYS[0]}):
        assert request(served, tls, "GET", "/v1/models", headers)[0] == 401
    # Behind the root path too, the probes need no key (the gate sees the route's own path).
    assert request(served, tls, "GET", "/health")[0] == 200


def test_a_cors_preflight_is_answered_before_the_key_is_asked_for(served, tls):
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    status, headers, _ = request(served, tls, "OPTIONS", "/v1/chat/completions", preflight)
    assert status == 200
    assert headers["access-control-allow-origin"] == ORIGIN
    assert headers["access-control-allow-credentials"] == "true"
    assert "POST" in headers["access-control-allow-methods"]
    stranger = {**preflight, "Origin": "https://elsewhere.example.com"}
    status, headers, _ = request(served, tls, "OPTIONS", "/v1/chat/completions", stranger)
    assert status == 400 and "access-control-allow-origin" not in headers
    # The answer itself, refused or not, carries the header a browser needs to read it.
    status, headers, _ = request(served, tls, "GET", "/v1/models", {"Origin": ORIGIN})
    assert status == 401 and headers["access-control-allow-origin"] == ORIGIN


def test_responses_carry_a_request_id(served, tls):
    auth = {"Authorization": f"Bearer {KEYS[0]}"}
    _, headers, _ = request(served, tls, "GET", "/v1/models", {**auth, "X-Request-Id": "abc-1"})
    assert headers["x-request-id"] == "abc-1"
    _, first, _ = request(served, tls, "GET", "/v1/models", auth)
    _, second, _ = request(served, tls, "GET", "/v1/models", auth)
    assert len(first["x-request-id"]) == 32 and first["x-request-id"] != second["x-request-id"]


def test_no_other_socket_can_share_the_port(served):
    """The frontends accept on the socket their supervisor bound, which has no SO_REUSEPORT:
    a socket that sets it (another server) cannot bind the port."""
    with socket.socket() as intruder:
        intruder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        intruder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with pytest.raises(OSError):
            intruder.bind(("127.0.0.1", served.port))


def test_a_second_server_on_the_port_is_refused_before_its_model_loads(served, tls, tiny_model_dir):
    assert_refused_before_the_model_loads(tiny_model_dir, served.port)
    assert request(served, tls, "GET", "/health")[0] == 200, "the first server serves on"


def test_a_port_another_program_listens_on_is_refused_at_once(tiny_model_dir):
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        port = free_port()
        other.bind(("127.0.0.1", port))
        other.listen()
        assert_refused_before_the_model_loads(tiny_model_dir, port)
