"""``conveyor serve --config FILE`` with the YAML of vLLM's documentation (model, host, port,
uvicorn-log-level) and more of vLLM's flags on the command line, two API servers among them:
both take connections, and a program that joins their port with SO_REUSEPORT gets none.

One server per module, started from the config file alone (no MODEL, no --port): ``--config
serve.yaml --api-server-count 2 --max-model-len auto --generation-config vllm
--override-generation-config '{"temperature": 0}' --kv-cache-memory-bytes 16M --max-num-seqs 8
--enable-prefix-caching --disable-log-stats --disable-log-requests``.
"""

from __future__ import annotations

import json
import queue
import shlex
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.frontend.http_helpers import (
    HTTP_READY,
    SERVE,
    ServedHttp,
    accepting_frontend,
    assert_refused_before_the_model_loads,
    free_port,
    frontend_pid_of,
    frontend_pids,
    get,
    post_json,
)
from tests.process_tree import descendants

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("http-vllm-config")]

COMMAND_LINE = shlex.split(
    "--api-server-count 2 --max-model-len auto --generation-config vllm "
    """--override-generation-config '{"temperature": 0}' --kv-cache-memory-bytes 16M """
    "--max-num-seqs 8 --enable-prefix-caching --disable-log-stats --disable-log-requests"
)


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedHttp]:
    folder = tmp_path_factory.mktemp("http-vllm-config")
    port = free_port()
    config = folder / "serve.yaml"
    config.write_text(
        f"model: {json.dumps(str(tiny_model_dir))}\nhost: 127.0.0.1\nport: {port}\n"
        'uvicorn-log-level: "info"\n'
    )
    log = folder / "serve.log"
    with log.open("w") as log_file:
        process = subprocess.Popen(
            [*SERVE, "--config", str(config), *COMMAND_LINE],
            stdout=subprocess.PIPE,
            stderr=log_file,
            text=True,
        )
    served = ServedHttp(process, log, port)
    lines: queue.Queue[str] = queue.Queue()
    assert process.stdout is not None
    threading.Thread(target=lambda: [lines.put(x) for x in process.stdout], daemon=True).start()
    deadline = time.monotonic() + 90.0
    try:
        while not served.base_url and time.monotonic() < deadline and process.poll() is None:
            try:
                match = HTTP_READY.match(lines.get(timeout=0.2).strip())
            except queue.Empty:
                continue
            served.base_url = match[1] if match else ""
        served.children = descendants(process.pid)
        assert served.base_url, f"conveyor serve did not become ready:\n{log.read_text()}"
        yield served
    finally:
        served.stop()


def test_the_config_files_model_host_and_port_serve(served, tiny_model_dir):
    assert served.base_url == f"http://127.0.0.1:{served.port}"
    status, text = get(served.base_url, "/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(text)["data"]] == [str(tiny_model_dir)]
    log = served.log.read_text()
    assert "--disable-log-requests has no effect here" in log


def test_both_api_servers_take_connections(served):
    pids = frontend_pids(served.process.pid)
    assert len(pids) == 2
    answered = {accepting_frontend(served.port, pids) for _ in range(40)}
    assert answered == set(pids), "new connections reached both frontends"
    # Opened at once, too: one shared socket gave a whole burst to the frontend awake first.
    burst = [socket.create_connection(("127.0.0.1", served.port), timeout=30) for _ in range(20)]
    try:
        assert {frontend_pid_of(sock, pids) for sock in burst} == set(pids)
    finally:
        for sock in burst:
            sock.close()


def test_a_program_that_joins_the_port_gets_no_connection(served, tiny_model_dir):
    """The frontends' SO_REUSEPORT group takes a socket of the same user that sets it too, but
    the supervisor's steering program never picks it; without SO_REUSEPORT (another conveyor
    serve) the port is refused before any model loads."""
    with socket.socket() as intruder:
        intruder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        intruder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        intruder.bind(("127.0.0.1", served.port))
        intruder.listen()
        intruder.setblocking(False)
        assert all(get(served.base_url, "/health")[0] == 200 for _ in range(30))
        with pytest.raises(BlockingIOError):
            intruder.accept()
    assert_refused_before_the_model_loads(tiny_model_dir, served.port)


def test_the_overridden_generation_config_makes_requests_greedy(served):
    # No temperature in the request: the override's 0, so both choices are the greedy text.
    body = {"prompt": "def main():", "max_tokens": 12, "n": 2, "ignore_eos": True}
    status, _, response = post_json(served.base_url, "/v1/completions", body)
    assert status == 200
    first, second = (choice["text"] for choice in response["choices"])
    assert first == second
