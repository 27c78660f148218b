"""Messages between the head node and the headless hosts that run the rest of its tensor-parallel
ranks: heartbeats both ways, and a host's last word when one of its workers is gone.

Shared by the engine-core process on the head (``conveyor.executor.node_link``) and the headless
supervisor on each other host (``entrypoints.headless``). The workers' own commands and replies
travel as today (``protocol.worker_messages``); these say only whether each host is still there,
which a host that vanished (power, network, ``kill -9`` of its whole tree) cannot say itself.

Data-parallel engines on other hosts (``entrypoints.dp_hosts``) announce themselves to the head's
supervisor with ``EngineAnnounce``: the head learns each remote engine's address and the public
key its socket presents from them.
"""

from __future__ import annotations

from typing import Union

import msgspec

from conveyor.protocol.codec import WireCodec


class NodeHeartbeat(msgspec.Struct, tag=30, array_like=True, gc=False):
    """Still here (node 0: the head; any other: a headless host)."""

    node_rank: int


class NodeFailure(msgspec.Struct, tag=31, array_like=True, gc=False):
    """A headless host is stopping because something on it failed (a worker exited, a signal)."""

    node_rank: int
    reason: str


class EngineAnnounce(msgspec.Struct, tag=32, array_like=True, gc=False):
    """A headless host serves data-parallel engine ``data_parallel_rank`` at ``address``; its
    socket presents ``server_key`` (z85, the host's public CURVE key; empty without keys)."""

    data_parallel_rank: int
    address: str
    server_key: str = ""


NodeMessage = Union[NodeHeartbeat, NodeFailure, EngineAnnounce]

NODE_MESSAGE: WireCodec[NodeMessage] = WireCodec(NodeMessage)
