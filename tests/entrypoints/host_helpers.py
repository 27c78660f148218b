"""Helpers for tests that run ``conveyor serve`` process trees ("hosts") and compare their tokens
with one rank in the test process.

Runs in the test process. Every wait here is bounded.
"""

from __future__ import annotations

import contextlib
import queue
import random
import re
import socket
import subprocess
import threading
import time
from pathlib import Path

from conveyor.engine_core import EngineCore
from conveyor.executor.backends import make_executor
from conveyor.frontend.engine_client import MPEngineClient
from tests.multiproc_helpers import generate, make_config, make_requests
from tests.process_tree import descendants

READY = re.compile(r"^ready: engine_core pid=(\d+) address=(\S+)\s*$")
# The engine flags of tests.multiproc_helpers.make_config, as the command line spells them.
ENGINE_FLAGS = ["--max-num-seqs", "8", "--max-num-batched-tokens", "48", "--max-model-len", "256"]
ENGINE_FLAGS += ["--kv-cache-memory", "2M", "--device", "cpu", "--tensor-parallel-size", "2"]


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports free on 127.0.0.1 now."""
    for base in random.sample(range(20000, 30000, 16), 50):
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + count):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
            return base
    raise RuntimeError("no free port range")


class Host:
    """One "host": a ``conveyor serve`` process tree, its stdout lines and its log."""

    def __init__(self, command: list[str], log: Path) -> None:
        self.log = log
        with log.open("w") as log_file:
            self.process = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=log_file, text=True
            )
        self.lines: queue.Queue[str] = queue.Queue()
        stdout = self.process.stdout
        assert stdout is not None
        threading.Thread(target=lambda: [self.lines.put(x) for x in stdout], daemon=True).start()

    def tree(self) -> list[int]:
        return [self.process.pid, *descendants(self.process.pid)]


def head_address(head: Host, timeout_s: float = 120.0) -> str:
    """The engine's address from the head's ready line (other lines before it are skipped)."""
    deadline = time.monotonic() + timeout_s
    match = None
    while match is None and time.monotonic() < deadline:
        try:
            match = READY.match(head.lines.get(timeout=max(deadline - time.monotonic(), 0.01)))
        except queue.Empty:
            break
    assert match, f"the head printed no ready line:\n{head.log.read_text()}"
    return match.group(2)


def reference_tokens(model_dir: Path) -> dict[str, list[int]]:
    """Every request's tokens with one rank in this process."""
    config = make_config(model_dir)
    core = EngineCore(config, make_executor(config, "inprocess"))
    try:
        return generate(core, make_requests())
    finally:
        core.shutdown()


def served_tokens(address: str) -> dict[str, list[int]]:
    requests = make_requests()
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    with MPEngineClient(address=address, ready_timeout_s=10.0) as client:
        # One message: the first step sees every request, as the reference's did.
        assert client.add_requests(requests) == []
        deadline = time.monotonic() + 60.0
        while client.has_unfinished_requests() and time.monotonic() < deadline:
            outputs = client.get_outputs(0.5)
            for output in outputs.outputs if outputs else []:
                tokens[output.request_id] += output.new_token_ids
    return tokens
