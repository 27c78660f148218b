"""One data-parallel engine core as a Ray actor (``--data-parallel-size N --executor-backend ray``).

Runs in a Ray worker process that Ray placed in the supervisor's engine placement group, on the
supervisor's node. Ray only places and supervises it: ``run`` is ``python -m conveyor.entrypoints.engine``'s
own ``run``, binding the same ZeroMQ address the frontends connect to and speaking the same msgspec
messages. Ray is imported only inside the methods and the engine only inside ``run``, so the
supervisor, which names this class to Ray, loads neither. The caller wraps it with ``ray.remote``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from conveyor.runtime.dirs import remove_runtime_dir
from conveyor.runtime.processes import pid_is_alive

_SUPERVISOR_POLL_S = 0.5


class RayEngine:
    def info(self) -> tuple[str, int]:
        """(the address of the Ray node this actor runs on, its pid)."""
        import ray

        return ray.util.get_node_ip_address(), os.getpid()

    def run(
        self, argv: list[str], env: dict[str, str], supervisor_pid: int, runtime_dir: str
    ) -> int:
        """Serve as one engine core until SIGTERM (0) or a failure (non-zero); its exit status.

        ``argv``: the engine's command line, without ``--parent-pid``: Ray, not the supervisor,
        is our parent, so the engine cannot watch its parent. Instead a thread here watches the
        supervisor's pid (it is on this node) and stops the engine as its own death would,
        removing the runtime folder the supervisor can no longer remove.
        """
        from conveyor.entrypoints.engine import run

        os.environ.update(env)  # a key folder's path and the log level, never a key
        _watch_supervisor(supervisor_pid, Path(runtime_dir))
        # Ray's worker loop runs tasks on the main thread, so the engine installs its own
        # SIGTERM handler there: the supervisor's SIGTERM is the usual clean stop.
        return run(argv)


def _watch_supervisor(supervisor_pid: int, runtime_dir: Path) -> None:
    def watch() -> None:
        while pid_is_alive(supervisor_pid):
            time.sleep(_SUPERVISOR_POLL_S)
        remove_runtime_dir(runtime_dir)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="supervisor-watch", daemon=True).start()
