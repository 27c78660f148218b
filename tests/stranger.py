"""A stranger on this machine: a process of another user (``nobody``, when the tests run as root)
that pushes a frame to a conveyor port over and over, once without CURVE and once with a key of
its own that nobody authorized.

Runs in the test process (``stranger``, a context manager) and as its child (``python -m
tests.stranger ADDRESS SERVER_KEY FRAME_HEX``): the child loads pyzmq first and then drops to
the other user, since that user may not read this interpreter's folders. It prints its uid once
its sockets are connecting, and stops by itself after ``LIFETIME_S`` should the test not stop it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import zmq

from tests.commands import CHECKOUT

NOBODY = 65534
LIFETIME_S = 120.0
SEND_INTERVAL_S = 0.05


def become_another_user() -> None:
    """As root: become ``nobody``, groups included (else stay who we are; the refusal the tests
    check is by key, so it holds for any user)."""
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)


def push_forever(address: str, server_key: bytes, frame: bytes) -> None:
    context = zmq.Context()
    plain = context.socket(zmq.PUSH)  # no CURVE at all: what a keyless head used to accept
    plain.connect(address)
    curved = context.socket(zmq.PUSH)  # CURVE with a key the head has never seen
    curved.curve_publickey, curved.curve_secretkey = zmq.curve_keypair()
    curved.curve_serverkey = server_key  # public: anyone may know it
    curved.connect(address)
    print(os.getuid(), flush=True)
    deadline = time.monotonic() + LIFETIME_S
    while time.monotonic() < deadline:
        for socket in (plain, curved):
            with contextlib.suppress(zmq.Again):
                socket.send(frame, zmq.NOBLOCK)
        time.sleep(SEND_INTERVAL_S)


@contextlib.contextmanager
def stranger(address: str, server_key: bytes, frame: bytes) -> Iterator[int]:
    """The stranger pushing ``frame`` to ``address`` while the block runs; yields its uid."""
    command = [sys.executable, "-m", "tests.stranger", address, server_key.decode(), frame.hex()]
    process = subprocess.Popen(command, cwd=CHECKOUT, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        uid = process.stdout.readline().strip()
        assert uid.isdigit(), f"the stranger did not start (exit {process.wait(5.0)})"
        yield int(uid)
    finally:
        process.kill()
        process.wait(5.0)


if __name__ == "__main__":
    become_another_user()
    push_forever(sys.argv[1], sys.argv[2].encode(), bytes.fromhex(sys.argv[3]))
