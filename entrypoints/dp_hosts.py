"""Data-parallel engines on several hosts: which ranks run here, how the engines on other hosts
announce themselves to the head, and how the head waits for them.

Runs in the supervisor (``conveyor serve``) of each host. The head runs ranks
``[0, --data-parallel-size-local)`` and the frontends; a host started with ``--headless
--data-parallel-start-rank R --data-parallel-size-local L`` runs ranks ``[R, R + L)``, each bound
at ``--data-parallel-rpc-port`` + rank on the interface that faces the head
(``engines.remote_engine_address``), and announces them (``EngineAnnounce``, once a second for
its whole life, so a head started later or restarted learns them too) to the head's rpc port on
``--data-parallel-address``. The head takes the announcements until every remote rank is known,
checks that each engine answers a session (CURVE: only hosts that trust each other's keys get
there), and only then starts its frontends, which treat those engines like their local ones.
Both ends need CURVE keys, loopback included: an announcement names where a rank's prompts go,
so one taken from anybody who reaches the port would hand that rank to them.
Nothing else crosses between the supervisors: a remote engine that dies is the remote
supervisor's to restart, and the head's frontends see it go (its heartbeats stop) and come back.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import socket
import threading
import time
from dataclasses import dataclass

import msgspec
import zmq

from conveyor.frontend.engine_client.session import EngineLiveness, EngineStartError
from conveyor.frontend.engine_client.session import connect as connect_session
from conveyor.protocol import ConfigError
from conveyor.protocol.codec import CLIENT_TO_ENGINE
from conveyor.protocol.messages import Goodbye
from conveyor.protocol.node_messages import NODE_MESSAGE, EngineAnnounce
from conveyor.runtime.zmq_security import (
    CurveKeys,
    SecureBinder,
    connect,
    keys_from_env,
    require_keys,
    with_server_key,
)

logger = logging.getLogger(__name__)

DEFAULT_RPC_PORT = 29550
ANNOUNCE_INTERVAL_S = 1.0
_POLL_MS = 100


def add_data_parallel_host_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--data-parallel-size-local",
        "-dpl",
        type=int,
        default=None,
        help="data-parallel engines on this host (default: all of --data-parallel-size); the "
        "rest run on other hosts (`--headless --data-parallel-start-rank R`)",
    )
    group.add_argument(
        "--data-parallel-start-rank",
        "-dpr",
        type=int,
        default=0,
        help="the first data-parallel rank on this host (0 on the head)",
    )
    group.add_argument(
        "--data-parallel-address",
        "-dpa",
        default="127.0.0.1",
        help="the head's address, as the hosts with data-parallel engines reach it",
    )
    group.add_argument(
        "--data-parallel-rpc-port",
        "-dpp",
        type=int,
        default=DEFAULT_RPC_PORT,
        help="the head listens here for engines on other hosts; engine rank r on another host "
        "listens on this port + r",
    )


@dataclass(frozen=True)
class DataParallelLayout:
    """Which data-parallel ranks run on this host, and where the head is."""

    size: int
    size_local: int
    start_rank: int
    address: str
    rpc_port: int

    def check(self, headless: bool) -> None:
        if not 1 <= self.size_local <= self.size - self.start_rank:
            raise ConfigError(
                f"--data-parallel-size-local must be in [1, {self.size - self.start_rank}] "
                f"(ranks from {self.start_rank} of {self.size}), got {self.size_local}"
            )
        if headless and self.start_rank < 1:
            raise ConfigError(
                "--headless runs tensor-parallel ranks (--nnodes >= 2, --node-rank >= 1) or "
                "data-parallel engines from rank 1 up (--data-parallel-start-rank >= 1)"
            )
        if not headless and self.start_rank != 0:
            raise ConfigError(
                "the head runs data-parallel ranks from 0: --data-parallel-start-rank 0"
            )
        if not 0 < self.rpc_port < 65536 - self.size:
            raise ConfigError(f"--data-parallel-rpc-port {self.rpc_port} leaves no room for ranks")

    @property
    def local_ranks(self) -> range:
        return range(self.start_rank, self.start_rank + self.size_local)

    @property
    def spans_hosts(self) -> bool:
        return self.size_local < self.size

    @property
    def announce_address(self) -> str:
        return f"tcp://{self.address}:{self.rpc_port}"

    def link_keys(self) -> CurveKeys:
        """This host's keys, without which no rank crosses between hosts (``InsecureAddressError``;
        ``conveyor serve`` checks it before anything starts)."""
        return require_keys(self.announce_address, keys_from_env())


def own_address_towards(host: str, port: int) -> str:
    """This host's address on the interface it reaches ``host`` by (what the head can reach)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))  # UDP: picks the route, sends nothing
        return probe.getsockname()[0]


class EngineAnnouncer(threading.Thread):
    """On a headless host: tell the head, once a second, where this host's engines listen."""

    def __init__(
        self, layout: DataParallelLayout, keys: CurveKeys, addresses: dict[int, str]
    ) -> None:
        super().__init__(name="engine-announcer", daemon=True)
        server_key = keys.public_key.decode()
        self._frames = [
            NODE_MESSAGE.encode(EngineAnnounce(rank, address, server_key))
            for rank, address in addresses.items()
        ]
        self._layout = layout
        self._keys = keys
        self._stopped = threading.Event()

    def run(self) -> None:
        context = zmq.Context()
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.SNDHWM, len(self._frames))  # only the latest news is worth sending
        try:
            connect(push, self._layout.announce_address, self._keys)
            while not self._stopped.wait(ANNOUNCE_INTERVAL_S):
                for frame in self._frames:
                    with contextlib.suppress(zmq.Again):  # no head yet: it hears the next one
                        push.send(frame, zmq.NOBLOCK)
        finally:
            push.close()
            context.term()

    def stop(self) -> None:
        self._stopped.set()
        self.join(2.0)


def wait_for_remote_engines(
    layout: DataParallelLayout, keys: CurveKeys, timeout_s: float
) -> dict[int, str]:
    """On the head: rank -> address of every engine on another host, once each has announced
    itself and answered a session; ``EngineStartError`` naming the missing ranks otherwise."""
    remote = [rank for rank in range(layout.size) if rank not in layout.local_ranks]
    deadline = time.monotonic() + timeout_s
    announced = _take_announcements(layout, keys, set(remote), deadline)
    missing = [rank for rank in remote if rank not in announced]
    if missing:
        raise EngineStartError(
            f"data-parallel engines {missing} did not announce themselves at "
            f"{layout.announce_address} within {timeout_s:g} s: is `conveyor serve --headless "
            f"--data-parallel-start-rank {missing[0]}` running on their host, is its public key "
            "in this host's authorized/ folder, and this host's in its authorized/head.key?"
        )
    for rank, address in sorted(announced.items()):
        try:
            _probe(address, max(deadline - time.monotonic(), 1.0))
        except EngineStartError as exc:
            raise EngineStartError(f"data-parallel engine {rank} at {address}: {exc}") from None
    return dict(sorted(announced.items()))


def _take_announcements(
    layout: DataParallelLayout, keys: CurveKeys, wanted: set[int], deadline: float
) -> dict[int, str]:
    """Listen on the rpc port until every wanted rank announced itself (or the deadline): a
    CURVE server, so only the hosts in authorized/ get a frame through."""
    context = zmq.Context()
    binder = SecureBinder(context, keys)
    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    announced: dict[int, str] = {}
    try:
        binder.bind(pull, f"tcp://{layout.address}:{layout.rpc_port}")
        while wanted - announced.keys() and time.monotonic() < deadline:
            if not pull.poll(_POLL_MS):
                continue
            try:
                message = NODE_MESSAGE.decode(pull.recv())
            except msgspec.DecodeError:
                continue  # only authenticated hosts get here; still, junk is dropped
            if isinstance(message, EngineAnnounce) and message.data_parallel_rank in wanted:
                address = _trusted_address(message, keys)
                if address is not None and message.data_parallel_rank not in announced:
                    logger.info(
                        "data-parallel engine %d is at %s", message.data_parallel_rank, address
                    )
                    announced[message.data_parallel_rank] = address
    finally:
        pull.close()
        binder.close()
        context.term()
    return announced


def _trusted_address(message: EngineAnnounce, keys: CurveKeys) -> str | None:
    """The announced address with its server key, if that key is one this host trusts: the
    frontends will send prompts there."""
    if not keys.allows(message.server_key.encode()):
        logger.warning(
            "data-parallel engine %d announced a server key not in authorized/: ignored",
            message.data_parallel_rank,
        )
        return None
    return with_server_key(message.address, message.server_key)


def _probe(address: str, timeout_s: float) -> None:
    """A throwaway session (Hello, Ready, Goodbye): the engine serves, and our keys get in."""
    context = zmq.Context()
    try:
        dealer, _ = connect_session(
            context, address, EngineLiveness(address), timeout_s, "ready-probe"
        )
        dealer.send(CLIENT_TO_ENGINE.encode(Goodbye()))
        dealer.close(linger=1000)
    finally:
        context.term()
