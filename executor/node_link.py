"""The head's side of tensor parallelism across hosts: where each channel listens, and heartbeats
with the headless hosts that run the other ranks.

Runs in the engine-core process on the head (node 0); ``entrypoints.headless`` is the other end.
A worker on another host has no pipe to this process and no exit status it can see, so each
headless host sends a heartbeat every interval and says why when it stops (``NodeFailure``); the
head sends its own, by which the hosts stop their workers when the head is gone. Everything is on
``master_addr``, from ``master_port`` up:

    P       torch.distributed's TCP store (rank 0 hosts it; not ZeroMQ, not authenticated)
    P+1     workers -> engine replies (one PULL for every rank)
    P+2     head -> hosts heartbeats (PUB)
    P+3     hosts -> head heartbeats and failures (PULL)
    P+4+r   engine -> rank r commands (one PUSH per rank)

Every one of those ZeroMQ sockets is a CURVE server (``runtime.zmq_security``): a group across
hosts needs keys, loopback included, since whoever connects there gets a rank's commands.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import msgspec
import zmq

from conveyor.protocol.config import NodeConfig
from conveyor.protocol.node_messages import NODE_MESSAGE, NodeFailure, NodeHeartbeat
from conveyor.runtime.zmq_security import SecureBinder

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeAddresses:
    """Every address of one multi-host tensor-parallel group, as workers connect to them."""

    distributed_init_method: str
    reply: str
    head_heartbeats: str
    node_heartbeats: str
    commands: tuple[str, ...]


def node_addresses(nodes: NodeConfig, tp_size: int) -> NodeAddresses:
    host, port = nodes.master_addr, nodes.master_port
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    base = f"tcp://{host}:"
    return NodeAddresses(
        distributed_init_method=f"{base}{port}",
        reply=f"{base}{port + 1}",
        head_heartbeats=f"{base}{port + 2}",
        node_heartbeats=f"{base}{port + 3}",
        commands=tuple(f"{base}{port + 4 + rank}" for rank in range(tp_size)),
    )


def local_ranks(nodes: NodeConfig, tp_size: int) -> range:
    """The global ranks node ``nodes.node_rank`` runs: an equal, contiguous share."""
    per_node = tp_size // nodes.nnodes
    return range(nodes.node_rank * per_node, (nodes.node_rank + 1) * per_node)


def heartbeat_interval_s(timeout_s: float) -> float:
    # Several heartbeats per timeout, so one late packet is not a lost host.
    return min(1.0, timeout_s / 5)


class NodeLink:
    """A thread that heartbeats every headless host and notes theirs; ``problem`` says if one is
    gone. Binds at construction (so a bad address or missing keys fail at once)."""

    def __init__(self, nodes: NodeConfig, tp_size: int, binder: SecureBinder) -> None:
        self.nodes = nodes
        self.tp_size = tp_size
        addresses = node_addresses(nodes, tp_size)
        self._publisher = binder.context.socket(zmq.PUB)
        self._publisher.setsockopt(zmq.LINGER, 0)
        binder.bind(self._publisher, addresses.head_heartbeats)
        self._inbox = binder.context.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        binder.bind(self._inbox, addresses.node_heartbeats)
        self._started = time.monotonic()
        self._last_heard: dict[int, float] = {}
        self._failure: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-link", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        interval_s = heartbeat_interval_s(self.nodes.timeout_s)
        beat = NODE_MESSAGE.encode(NodeHeartbeat(0))
        while not self._stop.is_set():
            self._publisher.send(beat)
            deadline = time.monotonic() + interval_s
            while (left_s := deadline - time.monotonic()) > 0 and not self._stop.is_set():
                if self._inbox.poll(max(1, int(left_s * 1000))):
                    self._note(self._inbox.recv())

    def _note(self, frame: bytes) -> None:
        try:
            message = NODE_MESSAGE.decode(frame)
        except msgspec.DecodeError:
            logger.warning("dropped a malformed %d-byte frame from a headless host", len(frame))
            return
        self._last_heard[message.node_rank] = time.monotonic()
        if isinstance(message, NodeFailure) and self._failure is None:
            self._failure = f"node {message.node_rank} failed: {message.reason}"

    def problem(self) -> str | None:
        """Why the group cannot go on (a host failed, never joined, or went silent), or None."""
        if self._failure is not None:
            return self._failure
        now = time.monotonic()
        for node in range(1, self.nodes.nnodes):
            ranks = local_ranks(msgspec.structs.replace(self.nodes, node_rank=node), self.tp_size)
            last = self._last_heard.get(node)
            if last is None and now - self._started > self.nodes.join_timeout_s:
                return (
                    f"node {node} (ranks {ranks.start}-{ranks.stop - 1}) did not join within "
                    f"{self.nodes.join_timeout_s:g} s: run `conveyor serve --headless "
                    f"--node-rank {node}` there with the same --master-addr/--master-port, and "
                    "put each host's public key in the other's authorized/ folder"
                )
            if last is not None and now - last > self.nodes.timeout_s:
                return (
                    f"node {node} (ranks {ranks.start}-{ranks.stop - 1}) is gone: no heartbeat "
                    f"for {now - last:.1f} s (timeout {self.nodes.timeout_s:g} s)"
                )
        return None

    def close(self) -> None:
        """Stop the thread and close its sockets (before the context is terminated)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        self._publisher.close(linger=0)
        self._inbox.close(linger=0)
