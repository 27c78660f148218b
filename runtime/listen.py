"""The HTTP port: bound once, before anything loads, and shared with no other program.

Runs in the supervisor (``conveyor serve`` binds its port before it starts the engine, so a port
another process holds is refused at once rather than after the model has loaded) and in a
frontend started by hand (``conveyor frontend``, which binds its own). The frontends inherit
their sockets from the supervisor.

One frontend gets a plain listening socket. Several get one socket each in a SO_REUSEPORT group,
so that the kernel spreads new connections over them: on one shared socket the frontend that
wakes first accepts a whole burst (20 connections opened at once all went to one of two). The
group is made safe in two ways. The port is first bound without SO_REUSEPORT, which fails if
anything listens there, so conveyor never joins another program's group. And a classic BPF
program attached to the group picks, for every new connection, one of the sockets bound here
(the kernel numbers a group's sockets in the order they listened), so a program of the same user
that binds the port with SO_REUSEPORT afterwards gets no connection. Where the kernel takes no
such program (not Linux), the frontends share one plain socket instead.
"""

from __future__ import annotations

import ctypes
import logging
import socket
import struct
import sys
from collections.abc import Iterable

logger = logging.getLogger(__name__)

# Connections the kernel completes and holds until a frontend accepts them.
LISTEN_BACKLOG = 2048
# <linux/socket.h>, <linux/filter.h>: attach a classic BPF program to a reuseport group; the
# program's loads of SKF_AD_OFF + SKF_AD_RANDOM read a random 32-bit number.
_SO_ATTACH_REUSEPORT_CBPF = 51
_SKF_AD_RANDOM = 0xFFFFF000 + 56
_LD_W_ABS, _ALU_MOD_K, _JEQ_K, _RET_K = 0x20, 0x94, 0x15, 0x06


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def bind_listening_socket(
    host: str, port: int, backlog: int = LISTEN_BACKLOG, reuse_port: bool = False
) -> socket.socket:
    """A socket listening on ``host``:``port``; ``OSError`` (EADDRINUSE) when another socket
    listens there (unless both set SO_REUSEPORT: ``reuse_port``). SO_REUSEADDR only lets it bind
    over an earlier server's connections still in TIME_WAIT."""
    family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


class ListeningSockets:
    """The port's sockets for ``count`` frontends: frontend i accepts on ``fileno(i)``."""

    def __init__(self, host: str, port: int, count: int) -> None:
        self.count = count
        self._sockets = [bind_listening_socket(host, port)]
        if count == 1 or sys.platform != "linux":  # elsewhere no steering: one shared socket
            return
        # Bound without SO_REUSEPORT, this one proved that nothing listens on the port: now
        # the group, every socket of it listening before any is steered to.
        self._sockets[0].close()
        self._sockets = []
        try:
            for _ in range(count):
                self._sockets.append(bind_listening_socket(host, port, reuse_port=True))
        except OSError:
            self.close()
            raise
        try:
            self.serve_only(range(count))
        except OSError as exc:
            logger.warning(
                "the kernel takes no connection-steering program (%s): the %d frontends share "
                "one socket, and connections may not spread evenly over them",
                exc,
                count,
            )
            self.close()
            self._sockets = [bind_listening_socket(host, port)]

    def fileno(self, index: int) -> int:
        return self._sockets[index % len(self._sockets)].fileno()

    def serve_only(self, indices: Iterable[int]) -> None:
        """Give new connections only to the frontends ``indices`` (a dead one's socket gets none
        until its replacement serves); none: all of them."""
        if len(self._sockets) == 1:
            return
        chosen = sorted(set(indices)) or list(range(self.count))
        program = _pick_at_random(chosen)
        buffer = ctypes.create_string_buffer(program)
        fprog = _SockFprog(len(program) // 8, ctypes.addressof(buffer))
        self._sockets[0].setsockopt(socket.SOL_SOCKET, _SO_ATTACH_REUSEPORT_CBPF, bytes(fprog))

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()


def _pick_at_random(indices: list[int]) -> bytes:
    """A classic BPF program that returns one of ``indices`` at random."""

    def op(code: int, k: int = 0, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("=HBBI", code, jt, jf, k)

    program = op(_LD_W_ABS, _SKF_AD_RANDOM) + op(_ALU_MOD_K, len(indices))
    for position, index in enumerate(indices):
        # A == position: return that socket's index; else skip the return.
        program += op(_JEQ_K, position, jt=0, jf=1) + op(_RET_K, index)
    return program + op(_RET_K, indices[0])
