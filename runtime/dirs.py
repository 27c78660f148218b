"""Private runtime folders: where ipc:// sockets, config files and rendezvous files live.

Runs in whichever process owns children (the supervisor, an engine core, an ``LLM`` caller).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def make_runtime_dir(prefix: str = "conveyor-") -> Path:
    """A fresh folder only this user can enter (0700) under $XDG_RUNTIME_DIR (per-user, in
    memory) or the temp folder.

    Short paths matter: a Unix socket path must fit in about 107 bytes.
    """
    base = os.environ.get("XDG_RUNTIME_DIR")
    if not base or not os.access(base, os.W_OK):
        base = None
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    path.chmod(0o700)
    return path


def remove_runtime_dir(path: Path | str) -> None:
    shutil.rmtree(path, ignore_errors=True)
