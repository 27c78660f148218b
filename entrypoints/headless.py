"""``conveyor serve MODEL --headless --nnodes N --node-rank K --master-addr A --master-port P
--tensor-parallel-size T``: this host's share of a tensor-parallel group whose engine core runs
on the head (node 0, the same command without ``--headless``).

Runs as the headless supervisor on a host other than the head. It starts this host's worker
ranks (``python -m conveyor.worker``, each handed its launch on stdin, as the head's engine does for its
own), which connect to the head's channels (ZeroMQ over TCP, CURVE: keys are required) and join
torch.distributed at A:P. Then it watches two things: its workers (one that exits is reported to
the head as a ``NodeFailure``, and everything here stops, exit 1) and the head's heartbeats (none
for the node timeout, or none at all within the join timeout: the head is gone; everything here
stops, exit 1). The head's Shutdown makes every worker exit 0, and then so does this process;
SIGTERM/SIGINT stop the workers and exit 0. The workers watch this process through their stdin
pipe, so even a SIGKILL here leaves no orphans on this host.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import subprocess
import time

import zmq

from conveyor.entrypoints.dp_hosts import add_data_parallel_host_args
from conveyor.entrypoints.serve_config import ServeConfig
from conveyor.executor.node_link import heartbeat_interval_s, local_ranks, node_addresses
from conveyor.executor.worker_processes import SHUTDOWN_GRACE_S, spawn_worker, worker_env
from conveyor.protocol import ConfigError, EngineConfig
from conveyor.protocol.node_messages import NODE_MESSAGE, NodeFailure, NodeHeartbeat
from conveyor.protocol.worker_messages import WorkerLaunch
from conveyor.runtime.dirs import make_runtime_dir, remove_runtime_dir
from conveyor.runtime.exit_codes import ExitCode
from conveyor.runtime.processes import describe_exit, terminate_processes, wait_for_exit
from conveyor.runtime.signals import ShutdownRequested, ignore_shutdown_signals, signals_held
from conveyor.runtime.zmq_security import (
    CURVE_KEYS_ENV,
    CurveKeys,
    CurveKeysError,
    InsecureAddressError,
    connect,
    keys_from_env,
    require_keys,
)

logger = logging.getLogger("conveyor.headless")

_POLL_MS = 100


def add_multi_host_args(parser: argparse.ArgumentParser) -> None:
    """``--headless`` and ``--curve-keys``; the node layout flags are engine args."""
    group = parser.add_argument_group("multiple hosts")
    group.add_argument(
        "--headless",
        action="store_true",
        help="no frontends: with --nnodes, run this host's tensor-parallel ranks (--node-rank > "
        "0) for the engine on the head (--master-addr); else run this host's data-parallel "
        "engines (--data-parallel-start-rank > 0) for the head's frontends "
        "(--data-parallel-address)",
    )
    add_data_parallel_host_args(group)
    group.add_argument(
        "--curve-keys",
        metavar="DIR",
        default=None,
        help="this host's CURVE keys and the public keys it trusts (`conveyor keys generate "
        "DIR`); needed across hosts (--nnodes, --data-parallel-size-local, --headless), loopback "
        f"included, and for any TCP address other hosts can reach (default: ${CURVE_KEYS_ENV})",
    )


def check_host_addresses(config: ServeConfig) -> None:
    """Refuse, with the reason, CURVE keys that cannot be read, or a layout across hosts
    (``--nnodes`` > 1, data-parallel ranks on other hosts, ``--headless``) without them, even on
    loopback: its peers are trusted with ranks and prompts. Raises ``CurveKeysError`` or
    ``InsecureAddressError``; the keys are those exported to the children."""
    keys = keys_from_env()
    nodes = config.engines.engine.parallel.nodes
    if nodes.nnodes > 1:
        require_keys(node_addresses(nodes, 0).distributed_init_method, keys)
    layout = config.hosts.data_parallel
    if layout is not None and layout.spans_hosts:
        require_keys(layout.announce_address, keys)


def run_headless(config: ServeConfig) -> int:
    """The headless supervisor's life: check, start the workers, watch, stop; the exit status."""
    try:
        engine = config.engines.engine
        nodes = engine.parallel.nodes
        if nodes.nnodes < 2 or nodes.node_rank == 0:
            raise ConfigError("--headless runs node 1 and up of --nnodes >= 2; node 0 is the head")
        master = node_addresses(nodes, 0).distributed_init_method
        node = HeadlessNode(engine, require_keys(master, keys_from_env()))
    except (ConfigError, CurveKeysError, InsecureAddressError) as exc:
        logger.error("%s", exc)
        return ExitCode.BAD_CONFIG
    try:
        node.start()
        return node.watch()
    except ShutdownRequested as signal_name:
        logger.info("%s: stopping this host's workers", signal_name)
        node.report(f"the headless host was stopped by {signal_name}")
        return ExitCode.OK
    finally:
        ignore_shutdown_signals()  # the cleanup is bounded; a second signal must not cut it
        node.stop()


class HeadlessNode:
    """This host's workers, and the heartbeat channel with the head."""

    def __init__(self, config: EngineConfig, keys: CurveKeys) -> None:
        self.config = config
        self.nodes = config.parallel.nodes
        tp_size = config.parallel.tensor_parallel_size
        self.addresses = node_addresses(self.nodes, tp_size)
        self.ranks = local_ranks(self.nodes, tp_size)
        self.runtime_dir = make_runtime_dir()
        self.processes: dict[int, subprocess.Popen[bytes]] = {}
        self._context = zmq.Context()
        self._inbox = self._context.socket(zmq.SUB)
        self._inbox.setsockopt(zmq.SUBSCRIBE, b"")
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._outbox = self._context.socket(zmq.PUSH)
        self._outbox.setsockopt(zmq.LINGER, 1000)  # a NodeFailure must get out before we exit
        connect(self._inbox, self.addresses.head_heartbeats, keys)
        connect(self._outbox, self.addresses.node_heartbeats, keys)
        self._started = time.monotonic()
        self._last_heard: float | None = None

    def start(self) -> None:
        env = worker_env(self.nodes)
        for rank in self.ranks:
            launch = WorkerLaunch(
                rank,
                self.config,
                self.addresses.commands[rank],
                self.addresses.reply,
                self.addresses.distributed_init_method,
                str(self.runtime_dir),
            )
            with signals_held():  # a signal now is raised once the handle is kept
                self.processes[rank] = spawn_worker(launch, env)
        logger.info(
            "node %d: started ranks %d-%d (pids %s) for the head at %s",
            self.nodes.node_rank,
            self.ranks.start,
            self.ranks.stop - 1,
            [p.pid for p in self.processes.values()],
            self.addresses.distributed_init_method,
        )

    def watch(self) -> int:
        """Heartbeat the head and watch it and the workers until one of them ends; exit status."""
        interval_s = heartbeat_interval_s(self.nodes.timeout_s)
        beat = NODE_MESSAGE.encode(NodeHeartbeat(self.nodes.node_rank))
        next_beat = 0.0
        while True:
            if time.monotonic() >= next_beat:
                self._send(beat)
                next_beat = time.monotonic() + interval_s
            if self._inbox.poll(_POLL_MS):
                self._hear_head()
            if any(process.poll() is not None for process in self.processes.values()):
                return self._workers_exited()
            problem = self._head_problem()
            if problem is not None:
                logger.error("%s; stopping this host's workers", problem)
                return ExitCode.FAILED

    def _hear_head(self) -> None:
        while self._inbox.poll(0):
            self._inbox.recv()  # any frame from the head's authenticated socket: it is there
        if self._last_heard is None:
            print(f"ready: node {self.nodes.node_rank} joined the head", flush=True)
        self._last_heard = time.monotonic()

    def _head_problem(self) -> str | None:
        now = time.monotonic()
        if self._last_heard is None and now - self._started > self.nodes.join_timeout_s:
            return (
                f"the head ({self.addresses.head_heartbeats}) was not heard within "
                f"{self.nodes.join_timeout_s:g} s: is it running, is this host's public key in "
                "its authorized/ folder, and the head's in authorized/head.key here?"
            )
        if self._last_heard is not None and now - self._last_heard > self.nodes.timeout_s:
            return f"the head is gone: no heartbeat for {now - self._last_heard:.1f} s"
        return None

    def _workers_exited(self) -> int:
        """A worker exited: all of them with 0 is the head's Shutdown, anything else a fault."""
        if not any(process.poll() for process in self.processes.values()):
            # The head's Shutdown reaches every rank at once: give the others a moment to follow.
            wait_for_exit(list(self.processes.values()), SHUTDOWN_GRACE_S)
        codes = {rank: process.poll() for rank, process in self.processes.items()}
        if all(code == 0 for code in codes.values()):
            logger.info("the head shut the group down")
            return ExitCode.OK
        failed = [(rank, code) for rank, code in codes.items() if code]
        if failed:
            rank, code = failed[0]
            pid = self.processes[rank].pid
            reason = f"worker rank {rank} (pid {pid}) {describe_exit(code)}"
        else:
            reason = f"worker ranks {sorted(r for r, c in codes.items() if c == 0)} exited alone"
        logger.error("%s; stopping this host's workers", reason)
        self.report(reason)
        return ExitCode.FAILED

    def report(self, reason: str) -> None:
        """Tell the head why this host stops (best effort: the head may be gone)."""
        self._send(NODE_MESSAGE.encode(NodeFailure(self.nodes.node_rank, reason)))

    def _send(self, frame: bytes) -> None:
        # Never block: before the head is up (or after it is gone) there is nobody to take it.
        with contextlib.suppress(zmq.Again):
            self._outbox.send(frame, zmq.NOBLOCK)

    def stop(self) -> None:
        """Stop the workers (SIGTERM, then SIGKILL) and release everything; bounded."""
        terminate_processes(list(self.processes.values()))
        for process in self.processes.values():
            if process.stdin is not None:
                with contextlib.suppress(OSError):
                    process.stdin.close()
        self._inbox.close()
        self._outbox.close()
        self._context.term()
        remove_runtime_dir(self.runtime_dir)
