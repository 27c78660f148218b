"""The worker processes of one executor: start them, talk to them, notice their death, stop them.

Runs in the engine-core process, and never imports torch: each worker is ``python -m conveyor.worker``
started through ``runtime.processes`` (``multiprocessing`` would import the worker's modules here
first).

Every socket is bound here, ipc:// in a private 0700 runtime folder; workers connect. One PUSH
per rank carries commands, so a step's frame is encoded once and the same bytes go to every rank;
one PULL collects the replies of every rank. The sockets are used under a lock, so ``close`` from
another thread (a signal handler, a finalizer) never races a wait in the engine's busy loop.

With ranks on other hosts (``nnodes > 1``) every channel is TCP on the master address instead
(CURVE, and refused without keys even on loopback), this process starts only the
head's own ranks, and a ``NodeLink`` heartbeats the other hosts (``conveyor.executor.node_link``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading

import zmq

from conveyor.executor.node_link import NodeLink, local_ranks, node_addresses
from conveyor.protocol import EngineConfig
from conveyor.protocol.config import NodeConfig
from conveyor.protocol.worker_messages import (
    LAUNCH_LENGTH_PREFIX,
    WORKER_COMMAND,
    WORKER_LAUNCH,
    Shutdown,
    WorkerLaunch,
)
from conveyor.runtime import cpu_isa
from conveyor.runtime.dirs import make_runtime_dir, remove_runtime_dir
from conveyor.runtime.processes import (
    WORKER_MODULE,
    spawn_module,
    terminate_processes,
    wait_for_exit,
)
from conveyor.runtime.signals import signals_held
from conveyor.runtime.zmq_security import (
    SecureBinder,
    faces_network,
    keys_from_env,
    require_keys,
)

logger = logging.getLogger(__name__)

# A worker that got Shutdown has this long to exit on its own before SIGTERM, then SIGKILL.
SHUTDOWN_GRACE_S = 2.0
# How long a command send may block (a full queue) before the workers are checked again.
_SEND_TIMEOUT_MS = 100
# How long a closing TCP command socket may still deliver Shutdown to a rank on another host.
_REMOTE_LINGER_MS = 1000


class WorkersClosedError(RuntimeError):
    """The worker processes were stopped; nothing more can be sent or received."""


class WorkerProcesses:
    """One process and one command socket per rank, one reply socket for all."""

    def __init__(self, num_workers: int, nodes: NodeConfig | None = None) -> None:
        self.num_workers = num_workers
        self.nodes = nodes or NodeConfig()
        self.runtime_dir = make_runtime_dir()
        self._lock = threading.Lock()
        self._closing = False
        self._context = zmq.Context()
        self._binder = SecureBinder(self._context, None)
        self._reply_socket = self._context.socket(zmq.PULL)
        self._command_sockets: list[zmq.Socket] = []
        self._node_link: NodeLink | None = None
        try:
            self._set_addresses()
            # Keys only matter (and are only read) when the channels are TCP: ranks on other
            # hosts, which must have them, loopback included (whoever connects gets prompts).
            if self.reply_address.startswith("tcp://"):
                keys = require_keys(self.reply_address, keys_from_env())
                self._binder = SecureBinder(self._context, keys)
            self._bind_sockets()
        except BaseException:
            self._release_sockets()
            remove_runtime_dir(self.runtime_dir)
            raise
        self.processes: list[subprocess.Popen[bytes]] = []

    def _set_addresses(self) -> None:
        self.local_ranks = local_ranks(self.nodes, self.num_workers)
        if self.nodes.nnodes == 1:
            self.reply_address = f"ipc://{self.runtime_dir}/replies"
            ranks = range(self.num_workers)
            self.command_addresses = [f"ipc://{self.runtime_dir}/rank{r}" for r in ranks]
            return
        addresses = node_addresses(self.nodes, self.num_workers)
        self.reply_address = addresses.reply
        self.command_addresses = list(addresses.commands)

    def _bind_sockets(self) -> None:
        # Each address as bound: a "tcp://HOST:*" becomes the port the system picked.
        self._binder.bind(self._reply_socket, self.reply_address)
        self.reply_address = _endpoint(self._reply_socket)
        for rank, address in enumerate(self.command_addresses):
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
            # TCP: a moment to deliver Shutdown to a rank on another host when closing.
            socket.setsockopt(zmq.LINGER, _REMOTE_LINGER_MS if address.startswith("tcp") else 0)
            self._command_sockets.append(socket)
            self._binder.bind(socket, address)
            self.command_addresses[rank] = _endpoint(socket)
        if self.nodes.nnodes > 1:
            self._node_link = NodeLink(self.nodes, self.num_workers, self._binder)
            self._node_link.start()

    @property
    def closing(self) -> bool:
        return self._closing

    def distributed_init_method(self) -> str | None:
        if self.num_workers == 1:
            return None
        if self.nodes.nnodes > 1:
            return node_addresses(self.nodes, self.num_workers).distributed_init_method
        # A file rendezvous in the private folder: no port to pick, nothing on the network.
        return f"file://{self.runtime_dir}/distributed-init"

    def start(self, config: EngineConfig) -> None:
        """Start this host's ranks; they load their shards in parallel and report ``WorkerReady``
        (as do the other hosts' ranks, over TCP)."""
        env = worker_env(self.nodes)
        for rank in self.local_ranks:
            launch = WorkerLaunch(
                rank,
                config,
                self.command_addresses[rank],
                self.reply_address,
                self.distributed_init_method(),
                str(self.runtime_dir),
            )
            with signals_held():  # a signal now is raised once the handle is kept
                self.processes.append(self._spawn(launch, env))

    def _spawn(self, launch: WorkerLaunch, env: dict[str, str]) -> subprocess.Popen[bytes]:
        return spawn_worker(launch, env)

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def exited(self) -> list[tuple[int, int]]:
        """(rank, returncode) of every local worker that exited; reaps them."""
        codes = [(rank, p.poll()) for rank, p in zip(self.local_ranks, self.processes)]
        return [(rank, code) for rank, code in codes if code is not None]

    def pid_of(self, rank: int) -> int:
        return self.processes[self.local_ranks.index(rank)].pid

    def remote_problem(self) -> str | None:
        """Why the ranks on other hosts cannot go on (silent, failed, never joined), or None."""
        return None if self._node_link is None else self._node_link.problem()

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
        self._stop_processes(grace_s)
        with self._lock:
            self._release_sockets()
        remove_runtime_dir(self.runtime_dir)

    def _stop_processes(self, grace_s: float) -> None:
        """After Shutdown was sent: wait ``grace_s`` for the workers, then stop them firmly."""
        live = wait_for_exit(self.processes, grace_s)
        terminate_processes(live)
        for process in self.processes:
            if process.stdin is not None:
                with contextlib.suppress(OSError):
                    process.stdin.close()

    def _release_sockets(self) -> None:
        if self._node_link is not None:
            self._node_link.close()
        for socket in self._command_sockets:
            socket.close()  # with the linger set at bind
        self._reply_socket.close(linger=0)
        self._binder.close()
        self._context.term()


def _endpoint(socket: zmq.Socket) -> str:
    return socket.getsockopt(zmq.LAST_ENDPOINT).decode()


# GNU OpenMP (torch's CPU build) spins this many times at a barrier before its thread sleeps,
# where its own default is 300,000 (milliseconds of a core). Beside another busy process a
# spinning thread holds a core that process, or its own partner, needs: on 2 cores with a
# 2-thread matmul loop beside it, `bench offline --workload equal` served 2x the tokens (median
# of 3: 467 against 241 tok/s) and one 200-token request took 0.6 s instead of 1.5-11.6 s; alone,
# 1,069 against 1,087 tok/s.
OPENMP_SPIN_COUNT = 3000


def openmp_env() -> dict[str, str]:
    """GOMP_SPINCOUNT for a worker, unless this environment already sets how OpenMP waits."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return {}
    return {"GOMP_SPINCOUNT": str(OPENMP_SPIN_COUNT)}


def worker_env(nodes: NodeConfig) -> dict[str, str]:
    """What a worker's environment adds: OpenMP's spin count (``openmp_env``), the library
    limits of CONVEYOR_CPU_ISA (so a program that imports conveyor gets them in its workers too;
    the user's own settings win), and gloo's interface when every peer is on loopback."""
    env = openmp_env()
    env.update({k: v for k, v in cpu_isa.library_env().items() if k not in os.environ})
    if sys.platform.startswith("linux") and not faces_network(f"tcp://{nodes.master_addr}:0"):
        # Every rank is on this machine: keep gloo's sockets on loopback rather than on the
        # interface the host name resolves to (internal sockets never face the network). Across
        # hosts gloo picks the interface the host name resolves to, or $GLOO_SOCKET_IFNAME.
        env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    return env


def spawn_worker(launch: WorkerLaunch, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """``python -m conveyor.worker`` with ``launch`` on its stdin, which then stays open and silent."""
    # A session of its own, as every conveyor process has (the workers ignore SIGINT anyway and
    # stop when told, or when the starter is gone). On Linux each session is a scheduling group
    # (autogroup): sharing one with the engine core, the workers' compute threads at times kept
    # every other process's threads off the cores for over a second (a frontend's /health, an
    # unrelated process's timer: up to 1.8 s, 2-core host, 4 streams and a 256-prompt request);
    # in a session of their own, never over 60 ms.
    process = spawn_module(WORKER_MODULE, env=env, stdin_pipe=True)
    frame = WORKER_LAUNCH.encode(launch)
    assert process.stdin is not None
    try:
        process.stdin.write(LAUNCH_LENGTH_PREFIX.pack(len(frame)) + frame)
        process.stdin.flush()
    except BrokenPipeError:
        # Died at once; the next wait reports it with its exit status.
        pass
    # The pipe's EOF is how the worker learns the process that started it is gone.
    return process
