"""The stored responses of one server: what GET /v1/responses/{id} and ``previous_response_id``
read, bounded in number, bytes and age.

Runs in an HTTP frontend process, on its CPU pool (every method does file I/O). A server's
frontends share one folder (``RESPONSES_DIR_ENV``, made by the supervisor in its runtime folder,
so it goes when the server does; a frontend started alone makes a private one), so a response
stored by one frontend is found whichever frontend a later request reaches. One file per
response, named by a hash of its id (ids are the client's to choose with vLLM's
``request_id``), written whole and renamed into place, so a reader never sees half of one.
Each ``put`` removes the expired files and then the oldest ones until the folder is within
its bounds; a ``get`` of an expired one removes it and finds nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from conveyor.frontend.server.request_models import ChatMessage
from conveyor.frontend.server.responses_models import ResponseObject
from conveyor.runtime.dirs import make_runtime_dir, remove_runtime_dir

RESPONSES_DIR_ENV = "CONVEYOR_RESPONSES_DIR"
SUFFIX = ".json"


@dataclass(frozen=True)
class StoreLimits:
    """``max_responses`` 0: nothing is stored (store: true and previous_response_id are
    refused)."""

    max_responses: int = 1000
    max_bytes: int = 256 << 20
    ttl_s: float = 3600.0

    @property
    def enabled(self) -> bool:
        return self.max_responses > 0


class StoredResponse(msgspec.Struct):
    response: ResponseObject
    # The conversation as chat messages, the response's output included (without its
    # instructions, which a later request does not inherit): what previous_response_id continues.
    messages: list[ChatMessage]


class ResponsesStore:
    def __init__(self, folder: Path, limits: StoreLimits) -> None:
        self.folder = folder
        self.limits = limits
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.json.Decoder(StoredResponse)

    def put(self, stored: StoredResponse) -> None:
        data = self._encoder.encode(stored)
        path = self._path(stored.response.id)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        temporary.write_bytes(data)
        os.replace(temporary, path)
        self._evict()

    def get(self, response_id: str) -> StoredResponse | None:
        path = self._path(response_id)
        try:
            with path.open("rb") as file:
                modified = os.fstat(file.fileno()).st_mtime
                data = file.read()
        except FileNotFoundError:
            return None
        if time.time() - modified > self.limits.ttl_s:
            path.unlink(missing_ok=True)
            return None
        stored = self._decoder.decode(data)
        return stored if stored.response.id == response_id else None

    def delete(self, response_id: str) -> bool:
        if self.get(response_id) is None:
            return False
        self._path(response_id).unlink(missing_ok=True)
        return True

    def _path(self, response_id: str) -> Path:
        name = hashlib.blake2b(response_id.encode(), digest_size=16).hexdigest()
        return self.folder / (name + SUFFIX)

    def _evict(self) -> None:
        """Expired files first, then the oldest until the count and the bytes fit."""
        entries = []
        now = time.time()
        with os.scandir(self.folder) as scan:
            for entry in scan:
                if not entry.name.endswith(SUFFIX):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    info = entry.stat()
                    if now - info.st_mtime > self.limits.ttl_s:
                        os.unlink(entry.path)
                    else:
                        entries.append((info.st_mtime, info.st_size, entry.path))
        entries.sort()
        count, size = len(entries), sum(e[1] for e in entries)
        for _, entry_size, path in entries:
            if count <= self.limits.max_responses and size <= self.limits.max_bytes:
                break
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            count, size = count - 1, size - entry_size


def store_folder() -> Path:
    """The folder the server's frontends share (``RESPONSES_DIR_ENV``), else a private one
    removed when this process exits."""
    named = os.environ.get(RESPONSES_DIR_ENV)
    if named:
        path = Path(named)
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        return path
    path = make_runtime_dir(prefix="conveyor-responses-")
    atexit.register(remove_runtime_dir, path)
    return path


def make_shared_dir(parent: Path) -> Path:
    """The responses folder of the frontends a supervisor starts (in its runtime folder)."""
    path = parent / "responses"
    path.mkdir(mode=0o700, exist_ok=True)
    return path
