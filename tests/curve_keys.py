"""Key folders for tests of CURVE-secured sockets between "hosts" on one machine."""

from __future__ import annotations

import shutil
from pathlib import Path

from conveyor.runtime.zmq_security import generate_keys


def trusted_key_dirs(root: Path) -> dict[str, Path]:
    """Three hosts' key folders under ``root``: the head and node 1 trust each other; the
    stranger is trusted by nobody (it knows the head's public key, as anyone may)."""
    dirs = {name: root / name for name in ("head", "node1", "stranger")}
    for directory in dirs.values():
        generate_keys(directory)
    shutil.copy(dirs["node1"] / "node.key", dirs["head"] / "authorized" / "node1.key")
    for name in ("node1", "stranger"):
        shutil.copy(dirs["head"] / "node.key", dirs[name] / "authorized" / "head.key")
    return dirs
