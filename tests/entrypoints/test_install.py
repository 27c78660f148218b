"""The quick start, for real: a fresh venv, ``pip install torch==2.13.0 && pip install .`` (not
editable), then from another directory ``conveyor --help``, ``conveyor serve --demo-prompt`` on
the embedded default model, and ``conveyor bench serve`` against it. What is installed is one
package, ``conveyor``, without the lab; and the directory the server starts in holds files named
like our packages that raise when imported: no process conveyor starts may pick them up.

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

from conveyor.worker.native import find_compiler
from tests.frontend.http_helpers import free_port
from tests.layout import PRODUCT
from tests.process_tree import descendants, kill_all, wait_until_gone

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# Everything pip is given: the package's folders and what pyproject.toml reads; the lab is copied
# too, so that the wheel is seen to leave it out.
SOURCE = ("conveyor", *PRODUCT, "benchmarks", "scripts")
SUBCOMMANDS = ("serve", "frontend", "generate", "bench", "keys", "plot-trace")
BENCH_SUBCOMMANDS = ("serve", "offline")
BUILD_COMPILED_PATHS = (
    "from conveyor.worker.attention.cpu_kernel import load_kernel; "
    "from conveyor.worker.layers.cpu_ops import load_token_ops; "
    "print(load_kernel() is not None, load_token_ops() is not None)"
)
# Files named like our packages (and the lab's), each raising if anything imports it.
DECOYS = (
    "conveyor.py",
    "protocol.py",
    "worker.py",
    "frontend.py",
    "runtime.py",
    "engine_core.py",
    "entrypoints.py",
    "executor.py",
    "bench.py",
    "benchmarks.py",
)
OFFLINE_API = (
    "import conveyor; from conveyor import LLM, SamplingParams; "
    "print(LLM.__module__, SamplingParams.__module__, conveyor.__file__)"
)
# What Python source looks like: a keyword or an indented line.
PYTHON_LOOKING = re.compile(r"\b(def|return|self|import|if|for|in|None|class)\b|\n {4}")


def _copy_source(to: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "build", "*.egg-info")
    for package in SOURCE:
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
    _check_one_installed_package(python, work)
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

    # From here on the directory conveyor starts in holds our packages' names: none may be used.
    for name in DECOYS:
        (work / name).write_text(f'raise ImportError("the caller\'s {name} was imported")\n')
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


def _check_one_installed_package(python: Path, cwd: Path) -> None:
    """top_level.txt says ``conveyor`` alone; the offline API imports from it; no lab module
    (benchmarks, studies, the GPU check, test-model makers) is installed."""
    site = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd, 60
    )
    site_packages = Path(site.strip())
    (dist_info,) = site_packages.glob("conveyor_llm-*.dist-info")
    assert (dist_info / "top_level.txt").read_text().split() == ["conveyor"]
    installed = (dist_info / "RECORD").read_text()
    # Beside the package and its metadata, only the console script (../../../bin/conveyor).
    outside = re.findall(
        r"^(?!conveyor/|conveyor_llm-|\.\./\.\./\.\./bin/conveyor,).*", installed, re.M
    )
    assert [line for line in outside if line] == [], outside
    for lab in ("benchmarks/", "model_maker", "tokenizer_maker", "gpu_check", "soak", "scaleout"):
        assert lab not in installed, lab
    loaded = _run([str(python), "-c", OFFLINE_API], cwd, 120).split()
    assert loaded[:2] == ["conveyor.frontend.llm", "conveyor.protocol.sampling_params"]
    assert Path(loaded[2]).is_relative_to(site_packages), loaded


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
