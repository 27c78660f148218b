"""The executor backends by name: ``--executor-backend mp|inprocess|ray``.

Runs in the engine-core process (``conveyor.entrypoints.engine``). The engine core may not import
the worker package (nor torch) and Ray is optional: each backend's modules are imported only when
it is chosen.
"""

from __future__ import annotations

from conveyor.executor.abstract import Executor
from conveyor.executor.inprocess import InProcessExecutor
from conveyor.executor.multiproc import MultiprocExecutor
from conveyor.protocol import EngineConfig

EXECUTOR_BACKENDS = ("mp", "inprocess", "ray")


def make_executor(config: EngineConfig, backend: str | None = None) -> Executor:
    """The executor for ``backend``: "mp" (one worker process per tensor-parallel rank, the
    default), "inprocess" (one worker inside this process: debugging, TP=1 only) or "ray" (one
    Ray actor per rank, placed on a running Ray cluster)."""
    if backend in (None, "mp"):
        return MultiprocExecutor(config)
    if backend == "ray":
        if config.parallel.nodes.nnodes > 1:
            raise ValueError("with --executor-backend ray, Ray places the ranks: no --nnodes")
        # Ray is an optional extra: imported only by the engine that asked for it.
        from conveyor.executor.ray_workers import RayWorkerProcesses

        return MultiprocExecutor(config, workers=RayWorkerProcesses(config))
    if backend == "inprocess":
        if config.parallel.tensor_parallel_size != 1:
            raise ValueError("the in-process executor runs one worker: tensor_parallel_size=1")
        # Only this backend loads a model here, so only it pays for importing torch.
        from conveyor.worker.worker import Worker

        return InProcessExecutor(Worker(config, rank=0))
    raise ValueError(f"executor backend must be one of {', '.join(EXECUTOR_BACKENDS)}: {backend!r}")
