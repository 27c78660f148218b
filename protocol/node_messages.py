"""Messages between the head node and the headless hosts that run the rest of its tensor-parallel
ranks: heartbeats both ways, and a host's last word when one of its workers is gone.

Shared by the engine-core process on the head (``engine_core.node_link``) and the headless
supervisor on each other host (``entrypoints.headless``). The workers' own commands and replies
travel as today (``protocol.worker_messages``); these say only whether each host is still there,
which a host that vanished (power, network, ``kill -9`` of its whole tree) cannot say itself.
"""

from __future__ import annotations

from typing import Union

import msgspec

from protocol.codec import WireCodec


class NodeHeartbeat(msgspec.Struct, tag=30, array_like=True, gc=False):
    """Still here (node 0: the head; any other: a headless host)."""

    node_rank: int


class NodeFailure(msgspec.Struct, tag=31, array_like=True, gc=False):
    """A headless host is stopping because something on it failed (a worker exited, a signal)."""

    node_rank: int
    reason: str


NodeMessage = Union[NodeHeartbeat, NodeFailure]

NODE_MESSAGE: WireCodec[NodeMessage] = WireCodec(NodeMessage)
