"""``--data-parallel-size N --executor-backend ray``: this host's engine cores as Ray actors.

Runs in the supervisor (``conveyor serve``), which joins the running Ray cluster as a driver.
Ray only places and supervises: one placement group for this host's engines, one bundle each
(``{"CPU": 1}``), every bundle pinned to this node by its ``node:IP`` resource, because the
engines bind the addresses the frontends already use (ipc:// folders, loopback tcp) and those
are this node's. Engines on other nodes would need ``tcp://`` addresses with CURVE keys there;
that is not done. Each engine's tensor-parallel ranks get a placement group of their own
(``conveyor.executor.ray_workers``, made by the engine actor, which owns it): a restarted engine gets
a fresh one, and its ranks may be placed on any node, as with one engine.

``RayEngineProcess`` is an ``EngineProcess`` to the supervisor: its exit code is the end of the
actor's ``run`` (a killed actor reads as killed by SIGKILL), so ``supervisor.watch`` restarts a
dead one in place, in the same bundle, within the engine restart budget. Stopping sends the
actor SIGTERM (it is on this node), waits, then kills it; the last engine stopped frees the
group. If the supervisor dies, Ray kills the actors it owns.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from typing import Any

from conveyor.engine_core.core_process import ENGINE_FAULT_ENV
from conveyor.entrypoints.ray_engine_actor import RayEngine
from conveyor.executor.ray_workers import (
    DEFAULT_PLACEMENT_TIMEOUT_S,
    RayPlacementError,
    ranks_group_name,
)
from conveyor.frontend.engine_client import EngineProcess, EngineStartError
from conveyor.protocol import EngineConfig
from conveyor.runtime.dirs import remove_runtime_dir
from conveyor.runtime.logs import LOG_LEVEL_ENV
from conveyor.runtime.signals import ShutdownRequested, install_shutdown_signals
from conveyor.runtime.zmq_security import CURVE_KEYS_ENV

logger = logging.getLogger(__name__)

# What an engine's actor reports when Ray says it died without returning (killed, node lost).
_ACTOR_DIED = -signal.SIGKILL
# Enough of the node's own resource to pin a bundle to it, however many bundles share it.
_ON_THIS_NODE = 0.001
_ENV_PASSED = (CURVE_KEYS_ENV, LOG_LEVEL_ENV, ENGINE_FAULT_ENV)


class RayEnginePlacement:
    """One placement group for this host's engines, made at the first start; ``engine`` makes
    the ``RayEngineProcess`` of the next bundle."""

    def __init__(self, num_engines: int, timeout_s: float = DEFAULT_PLACEMENT_TIMEOUT_S) -> None:
        self.num_engines = num_engines
        self.timeout_s = timeout_s
        self.group: Any = None
        self.actor_class: Any = None
        self._made: list[RayEngineProcess] = []
        self._stopped = 0

    def engine(self, config: EngineConfig, *args: Any, **kwargs: Any) -> RayEngineProcess:
        engine = RayEngineProcess(self, len(self._made), config, *args, **kwargs)
        self._made.append(engine)
        return engine

    def ensure_placed(self) -> None:
        if self.group is not None:
            return
        import ray
        from ray.util.placement_group import placement_group

        try:
            ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), ignore_reinit_error=True)
        except ConnectionError as exc:
            raise EngineStartError(
                f"--executor-backend ray joins a running Ray cluster (`ray start --head`, or "
                f"$RAY_ADDRESS): {exc}"
            ) from None
        # ray.init replaced our SIGTERM handler with its own: a signal must stop us cleanly.
        install_shutdown_signals()
        bundle = {"CPU": 1.0, f"node:{ray.util.get_node_ip_address()}": _ON_THIS_NODE}
        group = placement_group([bundle] * self.num_engines, strategy="STRICT_PACK")
        ready, _ = ray.wait([group.ready()], timeout=self.timeout_s)
        if not ready:
            ray.util.remove_placement_group(group)
            raise RayPlacementError(
                f"the Ray cluster could not place {self.num_engines} engine bundles of {bundle} "
                f"within {self.timeout_s:g} s ({ray.cluster_resources()} in the cluster)"
            )
        self.group, self.actor_class = group, ray.remote(RayEngine)

    def released(self) -> None:
        """One engine stopped for good; the last one frees the group."""
        self._stopped += 1
        if self._stopped == len(self._made) and self.group is not None:
            import ray

            ray.util.remove_placement_group(self.group)
            self.group = None


class RayEngineProcess(EngineProcess):
    """One engine core as a Ray actor in bundle ``bundle_index``: ``start``, ``wait_ready`` and
    ``stop`` it, poll ``exit_code``, as for an engine process."""

    def __init__(
        self, placement: RayEnginePlacement, bundle_index: int, *args: Any, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.placement = placement
        self.bundle_index = bundle_index
        self._actor: Any = None
        self._info_ref: Any = None
        self._run_ref: Any = None
        self._pid: int | None = None
        self._released = False

    def start(self) -> RayEngineProcess:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        try:
            self.placement.ensure_placed()
        except RayPlacementError as exc:
            raise EngineStartError(str(exc)) from None
        self.restore_folder()
        if self._actor is not None:
            self._free_dead_actor()
        strategy = PlacementGroupSchedulingStrategy(self.placement.group, self.bundle_index)
        actor_class = self.placement.actor_class
        self._actor = actor_class.options(num_cpus=1, scheduling_strategy=strategy).remote()
        # An actor runs its calls in order: info answers before run starts serving.
        self._info_ref = self._actor.info.remote()
        env = {name: os.environ[name] for name in _ENV_PASSED if os.environ.get(name)}
        # Ray, not this process, is the actor's parent; the runtime folder is ours to remove.
        argv = _without(_without(self.args, "--parent-pid"), "--runtime-dir")
        self._run_ref = self._actor.run.remote(argv, env, os.getpid(), str(self.runtime_dir))
        self._pid = None
        logger.info(
            "%s placed by Ray (bundle %d) at %s", self.name, self.bundle_index, self.address
        )
        return self

    def _free_dead_actor(self) -> None:
        """Free what a dead engine actor held: its bundle, and its ranks' group, which Ray
        does not remove when the actor that made it is killed."""
        import ray

        ray.kill(self._actor)
        name = ranks_group_name(self.config.parallel.data_parallel_rank)
        with contextlib.suppress(ValueError):  # none: the engine freed it, or never made it
            ray.util.remove_placement_group(ray.util.get_placement_group(name))

    @property
    def pid(self) -> int:
        import ray

        if self._pid is None:
            assert self._info_ref is not None, f"{self.name} was not started"
            _, self._pid = ray.get(self._info_ref, timeout=self.placement.timeout_s)
        return self._pid

    def exit_code(self) -> int | None:
        import ray

        if self._run_ref is None:
            return None
        try:
            done, _ = ray.wait([self._run_ref], timeout=0)
        except SystemError as error:
            # A SIGTERM that lands inside Ray's call runs our handler from Ray's signal check,
            # and Ray hands the ShutdownRequested back wrapped in a SystemError (seen in CI):
            # the stop the supervisor waits for, not a failure.
            if isinstance(error.__cause__, ShutdownRequested):
                raise error.__cause__ from None
            raise
        if not done:
            return None
        try:
            return int(ray.get(self._run_ref))
        except ray.exceptions.RayError:
            return _ACTOR_DIED

    def request_stop(self) -> None:
        import ray

        if self._run_ref is not None and self.exit_code() is None:
            # Gone, or it never had a pid; else on this node (see the bundle), so a signal reaches it.
            with contextlib.suppress(ProcessLookupError, ray.exceptions.RayError):
                os.kill(self.pid, signal.SIGTERM)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, then kill the actor after ``timeout_s``; removes the runtime folder and
        frees this engine's bundle. Idempotent."""
        import ray

        code = None
        if self._actor is not None:
            self.request_stop()
            ray.wait([self._run_ref], timeout=timeout_s)
            code = self.exit_code()
            ray.kill(self._actor)
        remove_runtime_dir(self.runtime_dir)
        if not self._released:
            self._released = True
            self.placement.released()
        return code


def _without(args: list[str], flag: str) -> list[str]:
    """``args`` less ``flag`` and its value."""
    if flag not in args:
        return list(args)
    at = args.index(flag)
    return args[:at] + args[at + 2 :]
