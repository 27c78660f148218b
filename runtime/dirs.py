"""Private runtime folders: where ipc:// sockets, config files and rendezvous files live.

Runs in whichever process owns children (the supervisor, an engine core, an ``LLM`` caller), and
in the engine core, which removes the folder it was started in when it exits. A folder names its
owner (pid and start time) in an ``owner`` file. Normally the owner, or the child that outlives
it, removes the folder; a folder whose owner died with everything it started (``kill -9`` of a
whole process group) is swept the next time any conveyor process makes one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from conveyor.runtime.processes import proc_stat_fields

PREFIX = "conveyor-"
OWNER_FILE = "owner"


def runtime_base() -> Path:
    """$XDG_RUNTIME_DIR (per-user, in memory) when writable, else the temp folder."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if not base or not os.access(base, os.W_OK):
        base = tempfile.gettempdir()
    return Path(base)


def make_runtime_dir(prefix: str = PREFIX) -> Path:
    """A fresh folder only this user can enter (0700), owned by this process.

    Short paths matter: a Unix socket path must fit in about 107 bytes.
    """
    sweep_stale_runtime_dirs(prefix)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=runtime_base()))
    path.chmod(0o700)
    (path / OWNER_FILE).write_text(_identity(os.getpid()) or str(os.getpid()))
    return path


def restore_runtime_dir(path: Path) -> None:
    """Make ``path`` again as ``make_runtime_dir`` did, owned by this process (a child that
    removed it when it exited is being started again)."""
    path.mkdir(mode=0o700, parents=False, exist_ok=True)
    owner = path / OWNER_FILE
    if not owner.exists():
        owner.write_text(_identity(os.getpid()) or str(os.getpid()))


def remove_runtime_dir(path: Path | str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def sweep_stale_runtime_dirs(prefix: str = PREFIX) -> list[Path]:
    """Remove this user's runtime folders whose owner process is gone; the ones removed."""
    removed = []
    with contextlib.suppress(OSError):
        for path in runtime_base().glob(f"{prefix}*"):
            with contextlib.suppress(OSError):
                if path.is_dir() and path.stat().st_uid == os.getuid() and _orphaned(path):
                    remove_runtime_dir(path)
                    removed.append(path)
    return removed


def _identity(pid: int) -> str | None:
    """pid and start time: a pid the kernel has since given to another process is not ours."""
    fields = proc_stat_fields(pid)
    return None if fields is None or fields[0] in ("Z", "X") else f"{pid} {fields[19]}"


def _orphaned(path: Path) -> bool:
    try:
        owner = (path / OWNER_FILE).read_text().split()
    except (OSError, ValueError):
        return False  # not ours to judge: made by an older version, or being made right now
    if not owner or not owner[0].isdigit():
        return False
    identity = _identity(int(owner[0]))
    return identity is None or (len(owner) == 2 and identity != " ".join(owner))
