"""Run a real ``conveyor serve`` with HTTP frontends for a test module, and talk to it.

Runs in the test process. ``ServedHttp`` starts the supervisor on a free port of 127.0.0.1,
waits (bounded) for both ready lines, and ``stop`` kills the supervisor and every process below
it, even when a test failed. ``post_raw`` speaks HTTP/1.1 over a plain socket, for the requests
the openai client will not send (bad JSON, chunked bodies, lying headers).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import queue
import random
import re
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conveyor.runtime.processes import FRONTEND_MODULE
from tests.commands import CONVEYOR
from tests.process_tree import descendants, kill_all

SERVE = [*CONVEYOR, "serve"]
ENGINE_READY = re.compile(r"^ready: engine_core pid=(\d+) address=(\S+)$")
# With --data-parallel-size N: one line per engine, engine_core-RANK.
DP_ENGINE_READY = re.compile(r"^ready: engine_core-(\d+) pid=(\d+) address=(\S+)$")
HTTP_READY = re.compile(r"^ready: (https?://\S+)$")
MODEL_NAME = "tiny"


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port free now and outside the ephemeral range, so that no outgoing connection on this
    busy machine takes it before the server binds it."""
    low, high = _ephemeral_range()
    candidates = [p for p in range(20000, 30000) if not low <= p <= high]
    for port in random.sample(candidates, 50):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port found")


@dataclass
class ServedHttp:
    process: subprocess.Popen[str]
    log: Path
    port: int
    engine_pid: int = 0
    engine_address: str = ""
    base_url: str = ""
    children: list[int] = field(default_factory=list)
    # Data-parallel engines: rank -> pid (from their ready lines).
    dp_engine_pids: dict[int, int] = field(default_factory=dict)
    # What it prints after the ready lines (the reader thread keeps filling it).
    stdout: queue.Queue[str] = field(default_factory=queue.Queue)

    def stop(self) -> None:
        self.children = list({*self.children, *descendants(self.process.pid)})
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(5.0)
        kill_all(self.children + descendants(self.process.pid))


def start_served_http(
    model_dir: Path,
    log: Path,
    extra: list[str],
    timeout_s: float = 90.0,
    env: dict[str, str] | None = None,
) -> ServedHttp:
    """``conveyor serve`` on a free port; returns once it printed ``ready: http://...``.

    ``env`` is added to the supervisor's environment (its children inherit it)."""
    for _ in range(3):
        served = _start_once(model_dir, log, extra, timeout_s, env)
        if served.base_url:
            return served
        served.stop()
        # Lost a race for the port: another one. Anything else is a failure.
        if "cannot listen" not in log.read_text():
            break
    raise AssertionError(f"conveyor serve did not become ready:\n{log.read_text()}")


def _start_once(
    model_dir: Path, log: Path, extra: list[str], timeout_s: float, env: dict[str, str] | None
) -> ServedHttp:
    port = free_port()
    command = [*SERVE, "--model", str(model_dir), "--kv-cache-memory", "16M"]
    command += ["--port", str(port), "--served-model-name", MODEL_NAME, *extra]
    with log.open("w") as log_file:
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=log_file,
            text=True,
            env={**os.environ, **(env or {})},
        )
    served = ServedHttp(process, log, port)
    lines = served.stdout
    assert process.stdout is not None
    threading.Thread(target=lambda: [lines.put(x) for x in process.stdout], daemon=True).start()
    deadline = time.monotonic() + timeout_s
    try:
        while not served.base_url and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.2).strip()
            except queue.Empty:
                if process.poll() is not None:
                    break  # it exited without the ready line: no point waiting
                continue
            if match := ENGINE_READY.match(line):
                served.engine_pid, served.engine_address = int(match[1]), match[2]
            elif match := DP_ENGINE_READY.match(line):
                served.dp_engine_pids[int(match[1])] = int(match[2])
            elif match := HTTP_READY.match(line):
                served.base_url = match[1]
    finally:
        served.children = descendants(process.pid)
    return served


def _healthy_or_gone(process: subprocess.Popen[bytes], base_url: str) -> bool:
    if process.poll() is not None:
        return True  # stop waiting: it exited
    try:
        return get(base_url, "/health")[0] == 200
    except OSError:
        return False


def start_attached_frontend(
    engine_address: str, log: Path, timeout_s: float = 60.0
) -> tuple[subprocess.Popen[bytes], str]:
    """``conveyor frontend`` attached to a running engine; returns once /health says 200."""
    for _ in range(3):
        port = free_port()
        command = [*CONVEYOR, "frontend", "--engine", engine_address]
        command += ["--port", str(port), "--served-model-name", MODEL_NAME]
        with log.open("w") as log_file:
            process = subprocess.Popen(command, stderr=log_file)
        base_url = f"http://127.0.0.1:{port}"

        wait_for(lambda p=process, u=base_url: _healthy_or_gone(p, u), timeout_s, 0.1)
        if process.poll() is None and _healthy_or_gone(process, base_url):
            return process, base_url
        process.kill()
        process.wait(5.0)
        if "cannot listen" not in log.read_text():
            break
    raise AssertionError(f"the attached frontend did not serve:\n{log.read_text()}")


def get(base_url: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    host, port = base_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("GET", path, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


def post_raw(
    base_url: str, path: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """POST exactly ``body``; response header names come back lower-cased."""
    host, port = base_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        all_headers = {"Content-Type": "application/json", **(headers or {})}
        connection.request("POST", path, body=body, headers=all_headers)
        response = connection.getresponse()
        headers_by_name = {k.lower(): v for k, v in response.getheaders()}
        return response.status, headers_by_name, response.read()
    finally:
        connection.close()


def post_json(
    base_url: str, path: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], Any]:
    status, response_headers, raw = post_raw(base_url, path, json.dumps(body).encode(), headers)
    return status, response_headers, json.loads(raw) if raw else None


def send_completion(
    base_url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    sock: socket.socket | None = None,
) -> socket.socket:
    """POST /v1/completions on a raw socket (``sock`` if given, already connected) and return it
    unread: the test decides when to read and when to hang up."""
    raw = json.dumps(body).encode()
    if sock is None:
        port = int(base_url.rsplit(":", 1)[1])
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    sock.sendall(f"{head}Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    return sock


def read_to_end(sock: socket.socket, received: bytes = b"") -> bytes:
    """Everything until the stream's [DONE] or the connection's end (bounded by the socket's
    timeout); a reset connection ends it too."""
    while b"data: [DONE]" not in received:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            break
        if not data:
            break
        received += data
    return received


def stream_payloads(raw: bytes) -> list[dict[str, Any]]:
    """The JSON events of a streamed response (chunked framing and [DONE] left out)."""
    return [json.loads(m) for m in re.findall(rb"data: (\{.*?\})\n\n", raw)]


def stream_text(raw: bytes) -> tuple[str, str | None]:
    """(text, finish_reason) of choice 0 of a streamed completion."""
    text, finish_reason = "", None
    for payload in stream_payloads(raw):
        for choice in payload.get("choices", []):
            text += choice["text"]
            finish_reason = choice["finish_reason"] or finish_reason
    return text, finish_reason


def frontend_pid_of(sock: socket.socket, pids: list[int], timeout_s: float = 10.0) -> int:
    """Which of the frontend processes ``pids`` accepted the connection ``sock``.

    Frontends share a port, so only the kernel knows: the server's end of the connection is the
    /proc/net/tcp entry whose ports mirror ours, and its inode is among that process's fds once
    accepted.
    """
    client_port, server_port = sock.getsockname()[1], sock.getpeername()[1]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        inodes = set()
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            local_port, remote_port = (int(f.split(":")[1], 16) for f in fields[1:3])
            if (local_port, remote_port) == (server_port, client_port) and fields[9] != "0":
                inodes.add(fields[9])
        for pid in pids:
            if inodes & _socket_inodes(pid):
                return pid
        time.sleep(0.05)
    raise AssertionError(f"no frontend of {pids} accepted the connection from port {client_port}")


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:[") : -1])
    return inodes


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (0 if it is gone)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def read_events(sock: socket.socket, num_events: int) -> bytes:
    """Read a streamed response until it holds ``num_events`` SSE events."""
    received = b""
    while received.count(b"data: ") < num_events:
        data = sock.recv(4096)
        assert data, f"the stream closed early: {received[-300:]!r}"
        received += data
    return received


def frontend_pids(supervisor_pid: int) -> list[int]:
    """The ``python -m conveyor.frontend`` processes below a supervisor."""
    pids = []
    for pid in descendants(supervisor_pid):
        with contextlib.suppress(OSError):
            if f"\0{FRONTEND_MODULE}\0".encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
    return pids


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value}, plus {"name": value} for unlabeled sums."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        samples[key] = float(value)
    return samples


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """The value of ``name`` whose labels include ``labels``; summed if several match.

    A scrape of any frontend reports the whole server (every frontend's requests).
    """
    total, found = 0.0, False
    for key, value in samples.items():
        key_name, _, label_text = key.partition("{")
        if key_name != name:
            continue
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            total, found = total + value, True
    assert found, f"no sample {name} {labels}"
    return total


def accepting_frontend(port: int, pids: list[int]) -> int:
    """Which of the frontends ``pids`` accepts a new connection to ``port`` (one GET /health)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        pid = frontend_pid_of(sock, pids)
        sock.recv(4096)
    return pid


def wait_for(condition: Any, timeout_s: float, interval_s: float = 0.05) -> Any:
    """Poll ``condition()`` until it returns something truthy; that value, or the last one."""
    deadline = time.monotonic() + timeout_s
    value = condition()
    while not value and time.monotonic() < deadline:
        time.sleep(interval_s)
        value = condition()
    return value


def assert_refused_before_the_model_loads(model_dir: Path, port: int) -> None:
    """``conveyor serve`` on ``port``, which another program holds, exits 2 at once, naming it,
    before it starts an engine."""
    started = time.monotonic()
    result = subprocess.run(
        [*SERVE, str(model_dir), "--port", str(port), "--kv-cache-memory", "16M"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}: [Errno 98]" in result.stderr
    assert "engine_core" not in result.stderr, "it started an engine first"
    assert time.monotonic() - started < 30
