"""The quick start, for real: a fresh venv, ``pip install torch==2.13.0 && pip install .`` (not
editable), then from another directory ``conveyor --help``, ``conveyor serve --demo-prompt`` on
the embedded default model, and ``conveyor bench serve`` against it.

Runs in the test process; everything else in child processes. The source is copied to a temporary
folder, installed from there, and the copy deleted before anything runs: the installed command
cannot lean on a source tree. Slow (a venv, torch and the dependencies from the local wheel cache:
a minute or two), so one test does it all.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import threading
import venv
from pathlib import Path

import pytest

from tests.frontend.http_helpers import free_port
from tests.process_tree import descendants, kill_all, wait_until_gone
from worker.native import find_compiler

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "runtime", "engine_core", "worker", "frontend", "entrypoints", "benchmarks")
SUBCOMMANDS = ("serve", "frontend", "generate", "bench", "make-model", "plot-trace")
BENCH_SUBCOMMANDS = ("serve", "offline", "scheduler", "wire", "attention", "layers", "fake-server")
BUILD_COMPILED_PATHS = (
    "from worker.attention.cpu_kernel import load_kernel; "
    "from worker.layers.cpu_ops import load_token_ops; "
    "print(load_kernel() is not None, load_token_ops() is not None)"
)
# What Python source looks like: a keyword or an indented line.
PYTHON_LOOKING = re.compile(r"\b(def|return|self|import|if|for|in|None|class)\b|\n {4}")


def _copy_source(to: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "build", "*.egg-info")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, to / package, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, to / name)
    return to


def _run(command: list[str], cwd: Path, timeout_s: float, env: dict[str, str] | None = None) -> str:
    environment = None if env is None else {**os.environ, **env}
    done = subprocess.run(
        command, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, env=environment
    )
    assert done.returncode == 0, f"{command}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done.stdout


def test_a_plain_pip_install_serves_the_default_model_from_any_directory(tmp_path: Path):
    env_dir, work = tmp_path / "venv", tmp_path / "elsewhere"
    work.mkdir()
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "-q", "torch==2.13.0"], work, 600)
    source = _copy_source(tmp_path / "source")
    _run([str(python), "-m", "pip", "install", "-q", str(source)], work, 600)
    shutil.rmtree(source)
    conveyor = str(env_dir / "bin" / "conveyor")

    usage = _run([conveyor, "--help"], work, 60)
    assert all(re.search(rf"^\s+{name}\b", usage, re.M) for name in SUBCOMMANDS), usage
    bench_usage = _run([conveyor, "bench", "--help"], work, 60)
    assert all(re.search(rf"^\s+{name}\b", bench_usage, re.M) for name in BENCH_SUBCOMMANDS)
    # The compiled CPU paths build from the installed sources alone (their headers included),
    # into an empty cache: without them the worker would fall back to torch ops, slower.
    if find_compiler() is not None:
        cache = {"CONVEYOR_CACHE": str(tmp_path / "cache")}
        built = _run([str(python), "-c", BUILD_COMPILED_PATHS], work, 120, cache)
        assert built.split() == ["True", "True"], built

    port = free_port()
    command = [conveyor, "serve", "--demo-prompt", "def main():", "--port", str(port)]
    log = tmp_path / "serve.log"
    with log.open("w") as log_file:
        server = subprocess.Popen(
            command, cwd=work, stdout=subprocess.PIPE, stderr=log_file, text=True
        )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in server.stdout], daemon=True).start()
    children: list[int] = []
    try:
        demo = _demo_completion(lines, log)
        children = descendants(server.pid)
        assert PYTHON_LOOKING.search(demo), f"the default model wrote no Python: {demo!r}"
        result = work / "bench.json"
        bench = [conveyor, "bench", "serve", "--base-url", f"http://127.0.0.1:{port}"]
        bench += ["--num-prompts", "50", "--random-input-len", "32", "--random-output-len", "16"]
        bench += ["--no-progress", "--result-json", str(result)]
        _run(bench, work, 300)
        report = json.loads(result.read_text())
        assert (report["completed"], report["failed"]) == (50, 0)
        assert report["model_id"] == "conveyor-tiny" and report["total_output_tokens"] == 50 * 16
        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0, log.read_text()[-3000:]
        assert wait_until_gone(children, 10.0) == []
    finally:
        kill_all([*children, *descendants(server.pid)])
        if server.poll() is None:
            server.kill()
            server.wait(5)


def _demo_completion(lines: queue.Queue[str], log: Path, timeout_s: float = 180.0) -> str:
    """The text ``--demo-prompt`` printed: from ``completion (...):`` to ``try: curl``."""
    text: list[str] = []
    try:
        while not (line := lines.get(timeout=timeout_s)).startswith("try: curl "):
            if text or line.startswith("completion ("):
                text.append(line)
    except queue.Empty:
        raise AssertionError(f"no demo completion:\n{log.read_text()[-4000:]}") from None
    assert text, log.read_text()[-4000:]
    return "".join(text[1:])
