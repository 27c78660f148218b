"""Start an engine-core process (``python -m engine_core``), wait until it serves, stop it.

Runs in the process that owns the engine: an ``LLM`` caller, an ``MPEngineClient`` or
``scripts/serve.py``. The engine gets a private runtime folder (0700) holding its config file and
its ipc:// socket, is told our pid so it dies with us, and runs in its own session so a Ctrl-C in
the terminal reaches only us: we decide how the engine stops.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec
import zmq

from frontend.engine_session import (
    DEFAULT_READY_TIMEOUT_S,
    EngineLiveness,
    decode_ready_config,
    handshake,
)
from protocol import EngineConfig
from protocol.codec import CLIENT_TO_ENGINE
from protocol.messages import Goodbye

logger = logging.getLogger(__name__)

_REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_STOP_TIMEOUT_S = 10.0


def private_runtime_dir() -> Path:
    """A fresh 0700 folder under $XDG_RUNTIME_DIR (per-user, in memory) or the temp folder."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if not base or not os.access(base, os.W_OK):
        base = None
    return Path(tempfile.mkdtemp(prefix="conveyor-", dir=base))


class EngineProcess:
    """One engine-core child process. ``start`` it, ``wait_ready``, and always ``stop`` it."""

    def __init__(
        self,
        config: EngineConfig,
        executor_backend: str | None = None,
        heartbeat_timeout_s: float | None = None,
        address: str | None = None,
        log_level: str | None = None,
        allow_remote_clients: bool = False,
    ) -> None:
        self.config = config
        self.runtime_dir = private_runtime_dir()
        self.address = address or f"ipc://{self.runtime_dir / 'engine.sock'}"
        config_file = self.runtime_dir / "engine-config.msgpack"
        config_file.write_bytes(msgspec.msgpack.encode(config))
        self.command = [sys.executable, "-m", "engine_core", "--config-file", str(config_file)]
        self.command += ["--address", self.address, "--parent-pid", str(os.getpid())]
        if executor_backend is not None:
            self.command += ["--executor-backend", executor_backend]
        if heartbeat_timeout_s is not None:
            self.command += ["--heartbeat-timeout-s", str(heartbeat_timeout_s)]
        if log_level is not None:
            self.command += ["--log-level", log_level]
        if allow_remote_clients:
            self.command.append("--allow-remote-clients")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None, "not started"
        return self.process.pid

    def start(self) -> EngineProcess:
        """Spawn the child. Call from a long-lived thread: the child's parent-death signal fires
        when the thread that forked it ends."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO_ROOT), env.get("PYTHONPATH")]))
        self.process = subprocess.Popen(self.command, env=env, start_new_session=True)
        logger.info("started engine core, pid %d, at %s", self.process.pid, self.address)
        return self

    def exit_code(self) -> int | None:
        """None while running; reaps the child once it has exited."""
        return None if self.process is None else self.process.poll()

    def liveness(self) -> EngineLiveness:
        return EngineLiveness(self.address, exit_code=self.exit_code)

    def wait_ready(self, timeout_s: float = DEFAULT_READY_TIMEOUT_S) -> EngineConfig:
        """Block until the engine answers a Hello (stopping it if it never does); its config.

        A throwaway session (Hello, Ready, Goodbye) proves the engine serves clients, the same
        path every real client takes.
        """
        context = zmq.Context()
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 1000)
        try:
            socket.connect(self.address)
            ready = handshake(socket, self.liveness(), timeout_s, client_name="ready-probe")
            socket.send(CLIENT_TO_ENGINE.encode(Goodbye()))
        except BaseException:
            self.stop()
            raise
        finally:
            socket.close()
            context.term()
        return decode_ready_config(ready)

    def stop(self, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``; removes the runtime folder. Idempotent."""
        code = None
        if self.process is not None:
            code = terminate(self.process, timeout_s)
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
        return code


def terminate(process: subprocess.Popen[bytes], timeout_s: float) -> int | None:
    """Stop a child politely, then firmly; returns its exit code (None if it survived both)."""
    # Popen's send_signal and kill do nothing for a child that has already been reaped.
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        logger.warning("pid %d ignored SIGTERM for %.0f s: killing it", process.pid, timeout_s)
    process.kill()
    try:
        return process.wait(5.0)
    except subprocess.TimeoutExpired:
        return None
