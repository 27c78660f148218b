"""The worker processes of one executor: start them, talk to them, notice their death, stop them.

Runs in the engine-core process, and never imports torch: each worker is ``python -m worker``
started through ``runtime.processes`` (``multiprocessing`` would import the worker's modules here
first).

Every socket is bound here, ipc:// in a private 0700 runtime folder; workers connect. One PUSH
per rank carries commands, so a step's frame is encoded once and the same bytes go to every rank;
one PULL collects the replies of every rank. The sockets are used under a lock, so ``close`` from
another thread (a signal handler, a finalizer) never races a wait in the engine's busy loop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading

import zmq

from protocol import EngineConfig
from protocol.worker_messages import (
    LAUNCH_LENGTH_PREFIX,
    WORKER_COMMAND,
    WORKER_LAUNCH,
    Shutdown,
    WorkerLaunch,
)
from runtime.dirs import make_runtime_dir, remove_runtime_dir
from runtime.processes import spawn_module, terminate_processes, wait_for_exit

logger = logging.getLogger(__name__)

# A worker that got Shutdown has this long to exit on its own before SIGTERM, then SIGKILL.
SHUTDOWN_GRACE_S = 2.0
# How long a command send may block (a full queue) before the workers are checked again.
_SEND_TIMEOUT_MS = 100


class WorkersClosedError(RuntimeError):
    """The worker processes were stopped; nothing more can be sent or received."""


class WorkerProcesses:
    """One process and one command socket per rank, one reply socket for all."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.runtime_dir = make_runtime_dir()
        self.reply_address = f"ipc://{self.runtime_dir}/replies"
        self.command_addresses = [f"ipc://{self.runtime_dir}/rank{r}" for r in range(num_workers)]
        self._lock = threading.Lock()
        self._closing = False
        self._context = zmq.Context()
        self._reply_socket = self._context.socket(zmq.PULL)
        self._reply_socket.bind(self.reply_address)
        self._command_sockets: list[zmq.Socket] = []
        for address in self.command_addresses:
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
            socket.bind(address)
            self._command_sockets.append(socket)
        self.processes: list[subprocess.Popen[bytes]] = []

    @property
    def closing(self) -> bool:
        return self._closing

    def distributed_init_method(self) -> str | None:
        if self.num_workers == 1:
            return None
        # A file rendezvous in the private folder: no port to pick, nothing on the network.
        return f"file://{self.runtime_dir}/distributed-init"

    def start(self, config: EngineConfig) -> None:
        """Start every rank; they load their shards in parallel and report ``WorkerReady``."""
        env = {}
        if sys.platform.startswith("linux"):
            # Every rank is on this machine: keep gloo's sockets on loopback rather than on the
            # interface the host name resolves to (internal sockets never face the network).
            env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
        for rank in range(self.num_workers):
            launch = WorkerLaunch(
                rank,
                config,
                self.command_addresses[rank],
                self.reply_address,
                self.distributed_init_method(),
                str(self.runtime_dir),
            )
            self.processes.append(self._spawn(launch, env))

    def _spawn(self, launch: WorkerLaunch, env: dict[str, str]) -> subprocess.Popen[bytes]:
        # The same session as the engine: the workers ignore SIGINT and stop when told (or when
        # the engine is gone), and stay in the engine's process group for a supervisor to scan.
        process = spawn_module("worker", env=env, new_session=False, stdin_pipe=True)
        frame = WORKER_LAUNCH.encode(launch)
        assert process.stdin is not None
        try:
            process.stdin.write(LAUNCH_LENGTH_PREFIX.pack(len(frame)) + frame)
            process.stdin.flush()
        except BrokenPipeError:
            # Died at once; the next wait reports it with its exit status.
            pass
        # The pipe stays open and silent: its EOF is how the worker learns this process is gone.
        return process

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def exited(self) -> list[tuple[int, int]]:
        """(rank, returncode) of every worker that exited; reaps them."""
        codes = [(rank, process.poll()) for rank, process in enumerate(self.processes)]
        return [(rank, code) for rank, code in codes if code is not None]

    def send(self, rank: int, frame: bytes) -> bool:
        """Queue ``frame`` for ``rank``; False if its queue stayed full (or it is gone)."""
        with self._lock:
            self._check_open()
            try:
                self._command_sockets[rank].send(frame, copy=False)
            except zmq.Again:
                return False
        return True

    def receive(self, timeout_ms: int) -> bytes | None:
        """One reply frame, or None if none came within ``timeout_ms``."""
        with self._lock:
            self._check_open()
            if not self._reply_socket.poll(timeout_ms):
                return None
            return self._reply_socket.recv()

    def _check_open(self) -> None:
        if self._closing:
            raise WorkersClosedError("the worker processes were shut down")

    def close(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        """Stop every worker (Shutdown, then SIGTERM after ``grace_s``, then SIGKILL) and
        release everything. Idempotent, bounded in time, and safe from any thread or a finalizer.
        """
        with self._lock:
            if self._closing:
                return
            self._closing = True
            goodbye = WORKER_COMMAND.encode(Shutdown())
            for socket in self._command_sockets:
                # A worker that is gone or stuck cannot take it; the signals below handle it.
                with contextlib.suppress(zmq.ZMQError):
                    socket.send(goodbye, zmq.NOBLOCK)
        live = wait_for_exit(self.processes, grace_s)
        terminate_processes(live)
        for process in self.processes:
            if process.stdin is not None:
                with contextlib.suppress(OSError):
                    process.stdin.close()
        with self._lock:
            for socket in (*self._command_sockets, self._reply_socket):
                socket.close(linger=0)
            self._context.term()
        remove_runtime_dir(self.runtime_dir)
