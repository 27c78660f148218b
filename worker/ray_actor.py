"""One tensor-parallel rank as a Ray actor (``--executor-backend ray``).

Runs in a Ray worker process that Ray placed in the engine's placement group. Ray only places and
supervises it: ``run`` is the same loop as ``python -m conveyor.worker`` (``worker.worker_process``),
talking to the engine over the same ZeroMQ sockets with the same msgspec messages. Ray is
imported only inside the methods, so this module costs nothing where Ray is not installed, and
so is the worker loop (torch): the engine process, which names this class to Ray, never loads it.
The caller wraps the class with ``ray.remote``.
"""

from __future__ import annotations

import os
import socket

from conveyor.protocol.worker_messages import WORKER_LAUNCH
from conveyor.runtime.logs import configure_logging


class RayWorker:
    def info(self) -> tuple[str, int]:
        """(the address of the Ray node this actor runs on, its pid)."""
        import ray

        return ray.util.get_node_ip_address(), os.getpid()

    def free_port(self) -> int:
        """A TCP port free on this node now: rank 0 hosts torch.distributed's store on it."""
        with socket.socket() as probe:
            probe.bind(("", 0))
            return probe.getsockname()[1]

    def run(self, launch_frame: bytes, env: dict[str, str]) -> int:
        """Serve as one rank until Shutdown (0) or a failure (non-zero); its exit status.

        ``env``: what a worker process would have inherited (gloo's interface, the key folder's
        path, the log level); this actor serves one rank, so it may set them for itself.
        """
        from conveyor.worker.worker_process import run_worker

        os.environ.update(env)
        launch = WORKER_LAUNCH.decode(launch_frame)
        configure_logging(f"worker-{launch.rank}")
        return run_worker(launch)
