"""conveyor serve, the supervisor: READY, serving, and no orphans however it ends.

Each test starts the real supervisor on the tiny model (engine core + one worker process). A
fixture finalizer kills the supervisor and every process it started, even when a test fails.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conveyor.entrypoints.supervisor import RestartBudget
from conveyor.frontend.engine_client import MPEngineClient
from conveyor.protocol import EngineCoreRequest, SamplingParams
from conveyor.runtime.dirs import runtime_base
from tests.commands import CONVEYOR
from tests.frontend.http_helpers import free_port
from tests.process_tree import descendants, kill_all, wait_until_gone

SERVE = [*CONVEYOR, "serve"]
READY = re.compile(r"^ready: engine_core pid=(\d+) address=(\S+)$")
HTTP_READY = re.compile(r"^ready: http://")


@dataclass
class Served:
    process: subprocess.Popen[str]
    log: Path
    engine_pid: int = 0
    address: str = ""
    children: list[int] = field(default_factory=list)


def _start(model_dir: Path, log: Path, frontends: int = 0, timeout_s: float = 60.0) -> Served:
    # Mostly the engine alone: tests/frontend/test_http_*.py run the supervisor with frontends.
    # The model as vLLM takes it: the first positional argument.
    command = [*SERVE, str(model_dir), "--kv-cache-memory", "16M"]
    command += ["--frontends", str(frontends), "--port", str(free_port())]
    with log.open("w") as log_file:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log_file, text=True)
    served = Served(process, log)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in process.stdout], daemon=True).start()
    try:
        match = READY.match(lines.get(timeout=timeout_s).strip())
        if match and frontends:
            assert HTTP_READY.match(lines.get(timeout=timeout_s)), "no ready: http line"
    except queue.Empty:
        match = None
    finally:
        served.children = descendants(process.pid)  # whatever started, for the finalizer
    assert match, f"conveyor serve printed no ready line:\n{log.read_text()}"
    served.engine_pid, served.address = int(match.group(1)), match.group(2)
    return served


@pytest.fixture
def serve(tiny_model_dir: Path, tmp_path: Path) -> Iterator:
    started: list[Served] = []

    def start(frontends: int = 0) -> Served:
        served = _start(tiny_model_dir, tmp_path / f"serve{len(started)}.log", frontends)
        started.append(served)
        return served

    yield start
    for served in started:
        if served.process.poll() is None:
            served.process.kill()
            served.process.wait(5.0)
        kill_all(served.children + descendants(served.process.pid))


def _generate(address: str) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with MPEngineClient(address=address, ready_timeout_s=10.0) as client:
        client.add_request(EngineCoreRequest("r", [5, 6, 7], params, time.time()))
        tokens: list[int] = []
        deadline = time.monotonic() + 30.0
        while client.has_unfinished_requests() and time.monotonic() < deadline:
            outputs = client.get_outputs(0.5)
            tokens += [t for o in outputs.outputs for t in o.new_token_ids] if outputs else []
    return tokens


@pytest.mark.slow
def test_sigterm_stops_everything_and_exits_zero(serve):
    served = serve()
    assert served.address.startswith("ipc://")
    assert len(_generate(served.address)) == 8
    children = descendants(served.process.pid)
    assert served.engine_pid in children and len(children) >= 2, "engine core and its worker"
    served.process.send_signal(signal.SIGTERM)
    assert served.process.wait(20.0) == 0
    assert wait_until_gone(children, 5.0) == []
    log = served.log.read_text()
    # Every process names itself in its log lines.
    assert f"serve[{served.process.pid}]" in log and f"engine_core[{served.engine_pid}]" in log


@pytest.mark.slow
def test_a_sigkilled_supervisor_leaves_no_orphans_and_no_runtime_folder(serve):
    """Rows 9 and 20: the engine, its worker and an HTTP frontend all notice and exit, and the
    runtime folders (the engine's socket and config, the frontends' ready files, the workers'
    sockets) go with them."""
    served = serve(frontends=1)
    children = descendants(served.process.pid)
    assert len(children) >= 3
    folders = _runtime_folders_of({served.process.pid, *children})
    assert Path(served.address.removeprefix("ipc://")).parent in folders
    assert len(folders) >= 2, "the engine's folder and its workers'"
    served.process.kill()
    served.process.wait(5.0)
    assert wait_until_gone(children, 10.0) == [], "children outlived the supervisor"
    assert [f for f in folders if f.exists()] == [], "runtime folders were left behind"


def _runtime_folders_of(pids: set[int]) -> list[Path]:
    """The conveyor runtime folders whose owner file names one of ``pids``."""
    found = []
    for folder in runtime_base().glob("conveyor-*"):
        try:
            owner = int((folder / "owner").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        if owner in pids:
            found.append(folder)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["engine_core", "worker"])
def test_a_dead_engine_or_worker_stops_the_supervisor_with_an_error(serve, victim):
    """Rows 6 and 7 at the supervisor (tests/frontend/test_http_openai.py has the streams)."""
    served = serve()
    children = descendants(served.process.pid)
    if victim == "engine_core":
        os.kill(served.engine_pid, signal.SIGKILL)
    else:
        (worker,) = descendants(served.engine_pid)
        os.kill(worker, signal.SIGKILL)
    assert served.process.wait(10.0) != 0
    assert wait_until_gone(children, 5.0) == []
    code = "-9" if victim == "engine_core" else "1"
    assert (
        f"engine_core (pid {served.engine_pid}) exited with code {code}" in served.log.read_text()
    )


def test_the_restart_budget_allows_so_many_restarts_per_window():
    now = [0.0]
    budget = RestartBudget(2, 60.0, clock=lambda: now[0])
    assert budget.take() and budget.take() and not budget.take()
    now[0] = 30.0
    assert not budget.take(), "both restarts are still within the window"
    now[0] = 60.5
    assert budget.take() and budget.num_recent == 1
    assert not RestartBudget(0, 60.0).take(), "0: never restart"


@pytest.mark.slow
def test_a_signal_while_the_model_loads_exits_cleanly(tiny_model_dir, tmp_path):
    """Row 11, at three moments of the start-up."""
    command = [*SERVE, "--model", str(tiny_model_dir)]
    command += ["--kv-cache-memory", "16M", "--frontends", "1", "--port", str(free_port())]
    # Wait for the state rather than sleep: under load a fixed delay can land before the
    # supervisor runs at all. 1 descendant: the engine is starting; 2: its worker loads the
    # model; 3: the frontend starts (imports, attaches, loads its tokenizer).
    for num_descendants in (1, 2, 3):
        log = tmp_path / f"serve-{num_descendants}.log"
        with log.open("w") as log_file:
            process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log_file)
        children: list[int] = []
        try:
            deadline = time.monotonic() + 30.0
            while len(children) < num_descendants and time.monotonic() < deadline:
                time.sleep(0.02)
                children = descendants(process.pid)
            assert len(children) >= num_descendants, "the supervisor never started its children"
            process.send_signal(signal.SIGTERM)
            assert process.wait(20.0) == 0, log.read_text()[-3000:]
            assert wait_until_gone(children, 5.0) == []
        finally:
            process.kill()
            process.wait(5.0)
            kill_all(children)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--frontends", "-1"], "--frontends must be >= 0"),
        (["--port", "0"], "--port must be"),
        (["--heartbeat-timeout-s", "1"], "--heartbeat-timeout-s must be at least 3"),
        (["--frontend-max-restarts", "-1"], "--frontend-max-restarts and --drain-timeout-s"),
        (["/elsewhere"], "MODEL '/elsewhere' and --model '/nonexistent' disagree"),
        (["--log-prompts"], "--log-prompts needs --enable-log-requests"),
        (["--frontends", "0", "--enable-log-requests"], "there are no frontends"),
        # Accepted, it killed the engine at the first request; every float flag: test_flags.py.
        (["--tbt-slo-ms", "nan"], "argument --tbt-slo-ms: must be a finite number, got 'nan'"),
    ],
)
def test_bad_frontend_flags_are_refused(flags, message):
    command = [*SERVE, "--model", "/nonexistent", *flags]
    result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and message in result.stderr
