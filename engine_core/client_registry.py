"""The frontends attached to this engine: ZMQ identity <-> client_index, and when each was last heard.

Runs in the engine-core process, owned by its I/O thread only (no locking). The engine core keys
requests by ``client_index`` (a small int, never reused), the socket routes by identity (bytes ZMQ
picked for the connection); this maps one to the other and says who went silent.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Client:
    identity: bytes
    client_index: int
    name: str
    last_seen: float


class ClientRegistry:
    def __init__(
        self, heartbeat_timeout_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._clock = clock
        self._by_identity: dict[bytes, Client] = {}
        self._by_index: dict[int, Client] = {}
        self._next_index = 0

    def __len__(self) -> int:
        return len(self._by_identity)

    def attach(self, identity: bytes, name: str = "") -> Client:
        """A Hello: the client, new or already known (a repeated Hello keeps its index)."""
        client = self._by_identity.get(identity)
        if client is None:
            client = Client(identity, self._next_index, name, self._clock())
            self._next_index += 1
            self._by_identity[identity] = client
            self._by_index[client.client_index] = client
        client.last_seen = self._clock()
        return client

    def touch(self, identity: bytes) -> Client | None:
        """Any frame from a client proves it alive; None for an identity that never said Hello."""
        client = self._by_identity.get(identity)
        if client is not None:
            client.last_seen = self._clock()
        return client

    def detach(self, identity: bytes) -> Client | None:
        client = self._by_identity.pop(identity, None)
        if client is not None:
            del self._by_index[client.client_index]
        return client

    def identity_of(self, client_index: int) -> bytes | None:
        client = self._by_index.get(client_index)
        return None if client is None else client.identity

    def identities(self) -> list[bytes]:
        return list(self._by_identity)

    def hear_all(self) -> None:
        """Count every client as heard now: after a stretch in which none could have been (this
        process was stopped or starved), each gets a whole timeout from here."""
        now = self._clock()
        for client in self._by_identity.values():
            client.last_seen = now

    def detach_silent(self) -> list[Client]:
        """Detach and return every client not heard from within the heartbeat timeout."""
        deadline = self._clock() - self.heartbeat_timeout_s
        silent = [c for c in self._by_identity.values() if c.last_seen < deadline]
        for client in silent:
            self.detach(client.identity)
        return silent
