"""``--executor-backend ray``: the tensor-parallel ranks as Ray actors in a placement group on an
existing Ray cluster (``ray start --head``; ``$RAY_ADDRESS`` names another one).

Runs in the engine-core process. Ray only places and supervises: one bundle per rank (a CPU, or
a GPU on CUDA), packed onto as few nodes as fit, one ``worker.ray_actor.RayWorker`` actor per
bundle. Messages travel exactly as with worker processes (``conveyor.executor.worker_processes``, whose
sockets this class keeps): ipc:// when every actor landed on this node, else TCP on this node's
address (CURVE, and refused off loopback without keys, as everywhere). A rank's end is the end of
its actor's ``run`` call: ``exited`` asks Ray, so a killed actor or a lost node is a dead worker
within the executor's poll interval. Closing kills the actors and frees the placement group; if
this process dies, Ray kills the actors it owns.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from conveyor.executor.worker_processes import WorkerProcesses, openmp_env, worker_env
from conveyor.protocol import EngineConfig
from conveyor.protocol.config import NodeConfig
from conveyor.protocol.worker_messages import WORKER_LAUNCH, WorkerLaunch
from conveyor.runtime.logs import LOG_LEVEL_ENV
from conveyor.runtime.zmq_security import CURVE_KEYS_ENV
from conveyor.worker.ray_actor import RayWorker

logger = logging.getLogger(__name__)

DEFAULT_PLACEMENT_TIMEOUT_S = 300.0
# What a rank's actor reports when Ray says it died without returning (killed, node lost).
_ACTOR_DIED = -9


def ranks_group_name(data_parallel_rank: int) -> str:
    """The ranks' group's name: a killed engine actor cannot free its group, so the supervisor
    finds it by name in the job's namespace and frees it (``ray_engines``)."""
    return f"conveyor-engine-{data_parallel_rank}-ranks"


class RayPlacementError(RuntimeError):
    """No Ray cluster to join, or it could not place the ranks in time."""


class RayWorkerProcesses(WorkerProcesses):
    def __init__(
        self, config: EngineConfig, placement_timeout_s: float = DEFAULT_PLACEMENT_TIMEOUT_S
    ) -> None:
        import ray

        self._ray = ray
        tp_size = config.parallel.tensor_parallel_size
        self._join_cluster()
        self._placement_group = self._place(config, tp_size, placement_timeout_s)
        self._actors: list[Any] = []
        self._run_refs: list[Any] = []
        try:
            self._start_actors(config, tp_size, placement_timeout_s)
            super().__init__(tp_size)
        except BaseException:
            self._stop_processes(0.0)
            raise

    def _join_cluster(self) -> None:
        try:
            self._ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), ignore_reinit_error=True)
        except ConnectionError as exc:
            raise RayPlacementError(
                f"--executor-backend ray joins a running Ray cluster (`ray start --head`, or "
                f"$RAY_ADDRESS): {exc}"
            ) from None

    def _place(self, config: EngineConfig, tp_size: int, timeout_s: float) -> Any:
        from ray.util.placement_group import placement_group

        self._bundle = {"GPU": 1.0} if config.device.startswith("cuda") else {"CPU": 1.0}
        name = ranks_group_name(config.parallel.data_parallel_rank)
        group = placement_group([self._bundle] * tp_size, strategy="PACK", name=name)
        ready, _ = self._ray.wait([group.ready()], timeout=timeout_s)
        if not ready:
            self._ray.util.remove_placement_group(group)
            raise RayPlacementError(
                f"the Ray cluster could not place {tp_size} bundles of {self._bundle} within "
                f"{timeout_s:g} s ({self._ray.cluster_resources()} in the cluster)"
            )
        return group

    def _start_actors(self, config: EngineConfig, tp_size: int, timeout_s: float) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_class = self._ray.remote(RayWorker)
        for rank in range(tp_size):
            strategy = PlacementGroupSchedulingStrategy(self._placement_group, rank)
            options = {"num_gpus": 1} if "GPU" in self._bundle else {"num_cpus": 1}
            self._actors.append(
                actor_class.options(scheduling_strategy=strategy, **options).remote()
            )
        infos = self._ray.get([actor.info.remote() for actor in self._actors], timeout=timeout_s)
        self._node_ips = [ip for ip, _ in infos]
        self._pids = [pid for _, pid in infos]
        self._here = self._ray.util.get_node_ip_address()
        self._spread = any(ip != self._here for ip in self._node_ips)
        self._store_port = self._ray.get(self._actors[0].free_port.remote()) if self._spread else 0
        logger.info("Ray placed ranks on %s (pids %s)", self._node_ips, self._pids)

    # ------------------------------------------------------------------ WorkerProcesses

    def _set_addresses(self) -> None:
        super()._set_addresses()
        if self._spread:
            # Some rank is on another node: TCP on this node's address, ports picked at bind.
            self.reply_address = f"tcp://{self._here}:*"
            self.command_addresses = [f"tcp://{self._here}:*"] * self.num_workers

    def distributed_init_method(self) -> str | None:
        if self.num_workers > 1 and self._spread:
            return f"tcp://{self._node_ips[0]}:{self._store_port}"
        return super().distributed_init_method()

    def _actor_env(self) -> dict[str, str]:
        # Across nodes gloo must leave loopback; on one node it stays there, as for processes.
        env = openmp_env() if self._spread else worker_env(NodeConfig())
        for name in (CURVE_KEYS_ENV, LOG_LEVEL_ENV):
            if os.environ.get(name):
                env[name] = os.environ[name]  # a key folder's path, never a key
        return env

    def start(self, config: EngineConfig) -> None:
        env = self._actor_env()
        for rank, actor in enumerate(self._actors):
            launch = WorkerLaunch(
                rank,
                config,
                self.command_addresses[rank],
                self.reply_address,
                self.distributed_init_method(),
            )
            self._run_refs.append(actor.run.remote(WORKER_LAUNCH.encode(launch), env))

    def pids(self) -> list[int]:
        return list(self._pids)

    def pid_of(self, rank: int) -> int:
        return self._pids[rank]

    def exited(self) -> list[tuple[int, int]]:
        """(rank, exit status) of every actor whose ``run`` ended, as Ray reports it."""
        refs = self._run_refs
        if not refs:
            return []
        done, _ = self._ray.wait(refs, num_returns=len(refs), timeout=0)
        return sorted((refs.index(ref), self._exit_status(ref)) for ref in done)

    def _exit_status(self, ref: Any) -> int:
        try:
            return int(self._ray.get(ref))
        except self._ray.exceptions.RayError:
            return _ACTOR_DIED

    def _stop_processes(self, grace_s: float) -> None:
        """Wait ``grace_s`` for the ranks to take Shutdown, then kill the actors, free the group."""
        if self._run_refs:
            self._ray.wait(self._run_refs, num_returns=len(self._run_refs), timeout=grace_s)
        for actor in self._actors:
            self._ray.kill(actor)
        self._ray.util.remove_placement_group(self._placement_group)
