"""ZeroMQ CURVE on the TCP sockets between conveyor processes: keys, who may connect, and the rule
that nothing faces the network unauthenticated.

Runs in every process that opens a TCP socket to another conveyor process: the engine core (its
clients' socket, its workers' channels), the workers, the frontends, a headless node. ipc://
sockets stay as they are (a private 0700 folder guards them), and so does loopback TCP unless keys
are given; a TCP address other hosts can reach is refused without keys, bound or connected. A
link between the processes of several hosts (data-parallel engines announcing themselves,
tensor-parallel ranks on other hosts) needs keys even on loopback (``require_keys``): whoever
answers there is trusted with a rank and its prompts, and every local user can reach a loopback
port.

Keys live in a folder made by ``conveyor keys generate DIR`` and named by ``--curve-keys DIR`` or
$CONVEYOR_CURVE_KEYS (a path, so no secret ever sits on a command line):

    node.key_secret    this host's key pair (0600, never leaves the host)
    node.key           its public half: copy it to the other hosts' authorized/
    authorized/*.key   public keys of the hosts whose processes may connect here; on a host that
                       is not the head, authorized/head.key is the head's key, by which its
                       processes check that they reached the head (a CURVE client must know its
                       server's key before it connects)

A server socket accepts a client only if ZAP finds the client's key among the authorized ones (or
this host's own); everything on the connection is then encrypted. A client checks the server's
key: the head's by default; a server elsewhere (a data-parallel engine on another host) is named
with its key, ``tcp://HOST:PORT?curve-server-key=KEY`` (``with_server_key``), since an address is
all an engine client is ever given. pyzmq is the one import here
beyond the standard library: every conveyor process already loads it.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from conveyor.runtime.refused_keys import RefusedKeys

logger = logging.getLogger(__name__)
# pyzmq's authenticator logs every ZAP request at DEBUG: one line per connection attempt, which
# anyone who reaches a CURVE port could multiply at will. Its errors still show.
_zap_logger = logging.getLogger(f"{__name__}.zap")
_zap_logger.setLevel(logging.WARNING)

CURVE_KEYS_ENV = "CONVEYOR_CURVE_KEYS"
KEY_NAME = "node"
AUTHORIZED_DIR = "authorized"
HEAD_KEY_FILE = "head.key"
# Between an address and the (public) key its server presents; no host:port contains it.
SERVER_KEY_MARK = "?curve-server-key="


class InsecureAddressError(ValueError):
    """A TCP address other hosts can reach, and no keys to guard the traffic."""


class CurveKeysError(ValueError):
    """A key folder that cannot be used; the message says why."""


@dataclass(frozen=True)
class CurveKeys:
    """One host's key pair and the public keys it trusts (z85 text, as ZeroMQ takes them)."""

    public_key: bytes
    secret_key: bytes = field(repr=False)
    authorized_keys: frozenset[bytes]
    # The key the head's sockets present: this host's own on the head, else authorized/head.key.
    head_key: bytes

    def allows(self, client_key: bytes) -> bool:
        return client_key == self.public_key or client_key in self.authorized_keys


def generate_keys(directory: str | os.PathLike[str]) -> Path:
    """Make a key folder (0700) with a new key pair; refuses to overwrite one. Returns node.key."""
    folder = Path(directory)
    if (folder / f"{KEY_NAME}.key_secret").exists():
        raise CurveKeysError(f"{folder} already holds a key pair; refusing to overwrite it")
    (folder / AUTHORIZED_DIR).mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.chmod(0o700)
    public_file, secret_file = zmq.auth.create_certificates(folder, KEY_NAME)
    Path(secret_file).chmod(0o600)
    return Path(public_file)


def load_keys(directory: str | os.PathLike[str]) -> CurveKeys:
    """Read a key folder made by ``generate_keys``, with the keys copied into authorized/."""
    folder = Path(directory)
    secret_file = folder / f"{KEY_NAME}.key_secret"
    if not secret_file.is_file():
        raise CurveKeysError(f"{secret_file} not found: make it with `conveyor keys generate DIR`")
    if secret_file.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        # As ssh does: a secret others can read is no longer this host's alone.
        raise CurveKeysError(f"{secret_file} is readable by other users: chmod 600 it")
    public_key, secret_key = zmq.auth.load_certificate(secret_file)
    if secret_key is None:
        raise CurveKeysError(f"{secret_file} holds no secret key")
    authorized_dir = folder / AUTHORIZED_DIR
    authorized = zmq.auth.load_certificates(authorized_dir) if authorized_dir.is_dir() else {}
    head_file = authorized_dir / HEAD_KEY_FILE
    head_key = zmq.auth.load_certificate(head_file)[0] if head_file.is_file() else public_key
    return CurveKeys(public_key, secret_key, frozenset(authorized), head_key)


def keys_from_env(environ: dict[str, str] | None = None) -> CurveKeys | None:
    """The keys $CONVEYOR_CURVE_KEYS names, or None when it is unset or empty."""
    directory = (os.environ if environ is None else environ).get(CURVE_KEYS_ENV)
    return load_keys(directory) if directory else None


def faces_network(address: str) -> bool:
    """True for a tcp:// address other hosts may reach (not loopback); ipc:// never does."""
    if not address.startswith("tcp://"):
        return False
    host = address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True  # "*", a host name or an interface name: assume the network


def with_server_key(address: str, server_key: str) -> str:
    """``address`` naming the public key its server must present (none: as it is)."""
    return f"{address}{SERVER_KEY_MARK}{server_key}" if server_key else address


def split_server_key(address: str) -> tuple[str, bytes | None]:
    """The endpoint ZeroMQ connects to, and the server key named with it (or None)."""
    endpoint, mark, key = address.partition(SERVER_KEY_MARK)
    return endpoint, (key.encode() if mark else None)


def check_address(address: str, keys: CurveKeys | None) -> None:
    """Raise ``InsecureAddressError`` if ``address`` would carry unauthenticated traffic."""
    if keys is None and faces_network(address):
        raise InsecureAddressError(
            f"{address} is reachable from other hosts and no CURVE keys were given: make them "
            f"with `conveyor keys generate DIR` and pass --curve-keys DIR (or ${CURVE_KEYS_ENV})"
        )


def require_keys(address: str, keys: CurveKeys | None) -> CurveKeys:
    """``keys``, which a TCP link between the processes of several hosts at ``address`` needs
    even on loopback; ``InsecureAddressError`` without them."""
    if keys is None:
        # Loopback is no shelter: any local user can connect to (or bind first) a loopback port,
        # and a peer on this link is trusted with a rank and the prompts sent to it.
        raise InsecureAddressError(
            f"{address} links conveyor processes of several hosts, which needs CURVE keys even "
            f"on loopback (any local user can reach a loopback port): make them with `conveyor "
            f"keys generate DIR` and pass --curve-keys DIR (or ${CURVE_KEYS_ENV}) on every host; "
            "on one host, --data-parallel-size or --tensor-parallel-size alone keeps every "
            "process on private ipc:// sockets"
        )
    return keys


def connect(
    socket: zmq.Socket, address: str, keys: CurveKeys | None, server_key: bytes | None = None
) -> None:
    """``socket.connect(address)`` as a CURVE client when keys are given and it is TCP.

    ``server_key``: the public key the server must present (default: the one named with the
    address, else the head's).
    """
    address, named_key = split_server_key(address)
    check_address(address, keys)
    if keys is not None and address.startswith("tcp://"):
        socket.curve_secretkey = keys.secret_key
        socket.curve_publickey = keys.public_key
        socket.curve_serverkey = server_key or named_key or keys.head_key
    socket.connect(address)


class SecureBinder:
    """Binds the server sockets of one ZMQ context, as CURVE servers when keys are given.

    ZAP is per context: the first CURVE bind starts the authenticator thread that checks each
    client's key; ``close`` stops it (call it before the context is terminated).
    """

    def __init__(self, context: zmq.Context, keys: CurveKeys | None) -> None:
        self.context = context
        self.keys = keys
        self._authenticator: ThreadAuthenticator | None = None
        # Touched only from the authenticator's thread (and by ``close`` once it stopped).
        self.refused = RefusedKeys()

    def bind(self, socket: zmq.Socket, address: str) -> None:
        check_address(address, self.keys)
        if self.keys is not None and address.startswith("tcp://"):
            self._start_authenticator()
            socket.curve_secretkey = self.keys.secret_key
            socket.curve_publickey = self.keys.public_key
            socket.curve_server = True
        socket.bind(address)

    def _start_authenticator(self) -> None:
        if self._authenticator is None:
            authenticator = ThreadAuthenticator(self.context, log=_zap_logger)
            authenticator.start()
            authenticator.configure_curve_callback("*", self)
            self._authenticator = authenticator

    def callback(self, domain: str, client_key: bytes) -> bool:
        """ZAP's question, from the authenticator's thread: may this client key connect?"""
        assert self.keys is not None
        allowed = self.keys.allows(client_key)
        if not allowed:
            self.refused.add(client_key)
        return allowed

    def close(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
            self.refused.flush()
