"""The process runtime: children started as installed modules, parents watched, signals held
while a child is spawned, runtime folders private, one log format."""

from __future__ import annotations

import logging
import os
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from conveyor.runtime import processes
from conveyor.runtime.dirs import make_runtime_dir, remove_runtime_dir, runtime_base
from conveyor.runtime.exit_codes import ExitCode
from conveyor.runtime.logs import LOG_LEVEL_ENV, log_level
from conveyor.runtime.processes import (
    ChildProcess,
    describe_exit,
    pid_is_alive,
    python_command,
    terminate,
)
from conveyor.runtime.signals import ShutdownRequested, install_shutdown_signals, signals_held

# Files named like ours in the directory a child starts in: each would fail the child if imported.
DECOYS = ("conveyor", "protocol", "runtime", "worker", "frontend", "engine_core", "entrypoints")


def _decoy_directory(path: Path) -> Path:
    for name in DECOYS:
        (path / f"{name}.py").write_text(f"raise SystemExit('the decoy {name}.py was imported')\n")
    return path


@pytest.mark.parametrize("form", ["this interpreter's", "python 3.10's"])
def test_a_child_never_imports_the_callers_directory(tmp_path: Path, form: str):
    """Children run conveyor's own modules whatever the directory they start in holds: -P on
    3.11+, and on 3.10 the working directory dropped from the path before anything is imported."""
    module, args = "conveyor.entrypoints.cli", ["--version"]
    command = python_command(module, args)
    if form == "python 3.10's":
        command = [sys.executable, "-c", processes._RUN_MODULE_WITHOUT_CWD, module, *args]
    elif sys.version_info >= (3, 11):
        assert command[1:3] == ["-P", "-m"]
    done = subprocess.run(
        command, cwd=_decoy_directory(tmp_path), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("conveyor "), done.stdout


def test_a_child_exits_when_its_stdin_pipe_closes():
    """The parent watch that needs no PDEATHSIG: EOF on a pipe the parent holds means it is gone."""
    code = "import time\nfrom conveyor.runtime.parent import exit_when_pipe_closes\n"
    code += "exit_when_pipe_closes(0)\ntime.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    try:
        assert child.stdin is not None
        child.stdin.close()
        assert child.wait(timeout=15) == ExitCode.PARENT_DIED
    finally:
        child.kill()
        child.wait(timeout=5)


def test_a_child_tied_to_its_parent_stops_when_the_parent_dies():
    """tie_to_parent: the kernel's signal (or the pid watch) turns the parent's death into a
    SIGTERM, which the child's handler turns into ShutdownRequested and a clean exit."""
    child_code = textwrap.dedent(
        """
        import os, sys, time
        from conveyor.runtime.parent import tie_to_parent
        from conveyor.runtime.signals import ShutdownRequested, install_shutdown_signals
        install_shutdown_signals()
        tie_to_parent(int(sys.argv[1]))
        print(os.getpid(), flush=True)
        try:
            time.sleep(30)
        except ShutdownRequested:
            sys.exit(0)
        sys.exit(1)
        """
    )
    parent_code = textwrap.dedent(
        f"""
        import os, subprocess, sys
        child = subprocess.Popen(
            [sys.executable, "-c", {child_code!r}, str(os.getpid())], stdout=subprocess.PIPE
        )
        print(child.stdout.readline().decode().strip(), flush=True)
        """
    )
    parent = subprocess.run(
        [sys.executable, "-c", parent_code], capture_output=True, text=True, timeout=30
    )
    child_pid = int(parent.stdout.strip())
    deadline = time.monotonic() + 10.0
    while pid_is_alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_is_alive(child_pid)


def test_a_signal_during_a_spawn_is_raised_once_the_spawn_is_done():
    install_shutdown_signals()
    try:
        with pytest.raises(ShutdownRequested, match="SIGTERM"), signals_held():
            os.kill(os.getpid(), signal.SIGTERM)
            # Still inside the block: the signal waits here, so a spawn cannot lose its handle.
            handle = subprocess.Popen([sys.executable, "-c", "pass"])
        assert handle.wait(timeout=10) == 0
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN, "later signals are ignored"
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def test_a_child_process_runs_an_installed_module_and_is_stopped(tmp_path):
    # runtime.processes starts children as ``python -m MODULE`` from any working directory.
    child = ChildProcess("sleeper", "http.server", ["0", "--bind", "127.0.0.1"])
    child.start()
    try:
        assert child.exit_code() is None and pid_is_alive(child.pid)
    finally:
        code = child.stop(timeout_s=5)
    assert code == -signal.SIGTERM and describe_exit(code) == "was killed by SIGTERM"
    assert not pid_is_alive(child.pid)


def test_terminate_kills_a_child_that_ignores_sigterm():
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True)"
    )
    code += "; time.sleep(30)"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert process.stdout is not None and process.stdout.readline()
    assert terminate(process, timeout_s=0.5) == -signal.SIGKILL


def test_runtime_dirs_are_private_and_removed():
    path = make_runtime_dir()
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
        assert (path / "owner").read_text().split()[0] == str(os.getpid())
    finally:
        remove_runtime_dir(path)
    assert not path.exists()


def test_a_folder_whose_owner_is_gone_is_swept_when_the_next_one_is_made():
    """Row 20's last resort: a whole process group SIGKILLed leaves its folders; the next
    conveyor process to make one removes them (and never a live owner's, or a stranger's)."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    stale, live, foreign = (Path(tempfile.mkdtemp(prefix="conveyor-", dir=runtime_base()))
                            for _ in range(3))  # fmt: skip
    (stale / "owner").write_text(dead.stdout.strip())
    (live / "owner").write_text(str(os.getpid()))
    # ``foreign`` has no owner file: made by something else, or being made right now.
    fresh = make_runtime_dir()
    try:
        assert not stale.exists() and live.exists() and foreign.exists()
    finally:
        for path in (stale, live, foreign, fresh):
            remove_runtime_dir(path)


def test_log_lines_name_the_process_and_levels_come_from_the_environment(monkeypatch):
    monkeypatch.setenv(LOG_LEVEL_ENV, "warning")
    assert log_level() == logging.WARNING and log_level("debug") == logging.DEBUG
    assert log_level("nonsense") == logging.INFO
    code = "import logging\nfrom conveyor.runtime.logs import configure_logging\n"
    code += "configure_logging('worker-3')\nlogging.getLogger('x').info('quiet')\n"
    code += "logging.getLogger('x').warning('hello')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0
    (line,) = done.stderr.strip().splitlines()  # the INFO line is below $CONVEYOR_LOG_LEVEL
    assert " worker-3[" in line and "] WARNING x: hello" in line


def test_a_signal_as_a_child_starts_leaves_its_handle_with_the_child_process(monkeypatch):
    """The signal lands while the child is spawned (as the supervisor's SIGTERM did while it
    started a frontend): ShutdownRequested is raised, and the ChildProcess has the handle, so
    the cleanup that follows stops the child instead of leaving it running."""
    from conveyor.runtime import processes

    real_popen = subprocess.Popen

    def popen_then_signal(*args, **kwargs):
        handle = real_popen(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return handle

    monkeypatch.setattr(processes.subprocess, "Popen", popen_then_signal)
    child = ChildProcess("sleeper", "http.server", ["0", "--bind", "127.0.0.1"])
    install_shutdown_signals()
    try:
        with pytest.raises(ShutdownRequested, match="SIGTERM"):
            child.start()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    assert child.process is not None and pid_is_alive(child.pid)
    assert child.stop(timeout_s=5) == -signal.SIGTERM
