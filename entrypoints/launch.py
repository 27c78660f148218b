"""One host's ``conveyor serve`` process tree: start its engine cores, learn where the engines on
other hosts are, start the frontends, then watch everything until it must stop.

Runs in the supervisor (``conveyor serve``; ``serve`` parses the flags and calls ``serve_host``).
On the head (the default) that is this host's data-parallel engines, the remote ones' addresses
(``dp_hosts``: with ``--data-parallel-size-local`` below ``--data-parallel-size``) and the HTTP
frontends, which get every engine's address in rank order. With ``--headless`` (data parallelism
across hosts) it is this host's engines alone, announced to the head and restarted in place when
they die, within the engine restart budget. Stopping (a signal, a fatal death) stops every child.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from conveyor.entrypoints.dp_hosts import (
    DataParallelLayout,
    EngineAnnouncer,
    own_address_towards,
    wait_for_remote_engines,
)
from conveyor.entrypoints.engines import (
    local_engine_addresses,
    make_engines,
    remote_engine_address,
    start_engines,
)
from conveyor.entrypoints.serve_config import FrontendsConfig, ServeConfig
from conveyor.entrypoints.supervisor import (
    FrontendProcess,
    FrontendStartError,
    RestartBudget,
    stop_all,
    wait_healthy,
    watch,
)
from conveyor.frontend.engine_client import EngineProcess, EngineStartError
from conveyor.frontend.server.main import api_key_env
from conveyor.frontend.server.metrics_dir import MULTIPROC_DIR_ENV, make_shared_dir
from conveyor.frontend.server.responses_store import RESPONSES_DIR_ENV
from conveyor.frontend.server.responses_store import make_shared_dir as make_responses_dir
from conveyor.protocol import EngineConfig
from conveyor.runtime.exit_codes import ExitCode
from conveyor.runtime.listen import ListeningSockets
from conveyor.runtime.processes import ChildProcess
from conveyor.runtime.signals import ShutdownRequested, ignore_shutdown_signals
from conveyor.runtime.zmq_security import CurveKeys, InsecureAddressError

logger = logging.getLogger("conveyor.serve")

# What the head does once every engine serves, given all their addresses in rank order.
OnServing = Callable[[list[str], Path, dict[str, ChildProcess]], None]


def serve_host(
    config: ServeConfig, on_serving: OnServing, listening: ListeningSockets | None = None
) -> int:
    """This host's tree, from start to exit status; ``listening``: the frontends' sockets."""
    engines_config, layout = config.engines, config.hosts.data_parallel
    assert layout is not None, "a host of tensor-parallel ranks runs no engine (headless)"
    headless = config.hosts.headless
    try:
        # Ranks cross between hosts only with keys (checked at start-up too): read them now.
        keys = layout.link_keys() if layout.spans_hosts else None
        addresses = _engine_addresses(engines_config.address, headless, layout)
    except InsecureAddressError as exc:
        logger.error("%s", exc)
        return ExitCode.BAD_CONFIG
    # Another host's engines must face the head: that is their point.
    allow_remote = engines_config.allow_remote_clients or headless
    engines = make_engines(
        engines_config.engine,
        engines_config.executor_backend,
        engines_config.heartbeat_timeout_s,
        addresses,
        allow_remote,
    )
    # Registered before they start: a signal at any point below still stops them.
    children: dict[str, ChildProcess] = {engine.name: engine for engine in engines}
    announcer = None
    try:
        model = config.model or "the embedded default model"
        _start_local_engines(model, engines, engines_config.ready_timeout_s)
        if headless:
            assert keys is not None, "a headless host's engines are part of a layout across hosts"
            announced = {e.config.parallel.data_parallel_rank: e.address for e in engines}
            announcer = EngineAnnouncer(layout, keys, announced)
            announcer.start()
        else:
            all_addresses = _all_engine_addresses(engines_config.engine, layout, engines, keys)
            # The frontends' ready files go beside engine 0's socket: the engine removes the
            # folder when it exits, so nothing is left even when this process is SIGKILLed.
            on_serving(all_addresses, engines[0].runtime_dir, children)
        death = watch_children(config, children, layout.size, listening)
        logger.error("%s; stopping everything", death)
        return ExitCode.FAILED
    except ShutdownRequested as signal_name:
        logger.info("%s: stopping everything", signal_name)
        return ExitCode.OK
    except (EngineStartError, FrontendStartError) as exc:
        logger.error("%s", exc)
        return ExitCode.FAILED
    finally:
        ignore_shutdown_signals()  # stopping the children must not itself be interrupted
        if announcer is not None:
            announcer.stop()
        stop_all(children, config.stop_timeout_s, config.frontends.drain_timeout_s)


def _engine_addresses(
    address: str | None, headless: bool, layout: DataParallelLayout
) -> dict[int, str | None]:
    """Where this host's engines listen: on the head, as --address says; on another host, the
    rpc port + rank on the interface facing the head (CURVE: its keys are required)."""
    if not headless:
        return local_engine_addresses(address, layout.local_ranks, layout.size)
    host = own_address_towards(layout.address, layout.rpc_port)
    return {r: remote_engine_address(host, layout.rpc_port, r) for r in layout.local_ranks}


def _start_local_engines(model: str, engines: list[EngineProcess], ready_timeout_s: float) -> None:
    served = start_engines(engines, ready_timeout_s)
    for engine, engine_config in zip(engines, served):
        blocks = engine_config.cache.num_blocks
        logger.info("%s serves %s with %d KV blocks", engine.name, model, blocks)
        print(f"ready: {engine.name} pid={engine.pid} address={engine.address}", flush=True)


def _all_engine_addresses(
    config: EngineConfig,
    layout: DataParallelLayout,
    engines: list[EngineProcess],
    keys: CurveKeys | None,
) -> list[str]:
    """Every engine's address in rank order: ours and, across hosts (``keys`` given), those the
    other hosts announce."""
    addresses = {e.config.parallel.data_parallel_rank: e.address for e in engines}
    if keys is not None:
        timeout_s = config.parallel.nodes.join_timeout_s
        remote = wait_for_remote_engines(layout, keys, timeout_s)
        for rank, address in remote.items():
            print(f"ready: remote engine_core-{rank} address={address}", flush=True)
        addresses.update(remote)
    return [addresses[rank] for rank in range(layout.size)]


def watch_children(
    config: ServeConfig,
    children: dict[str, ChildProcess],
    num_engines: int,
    listening: ListeningSockets | None = None,
) -> str:
    """Watch until a death stops everything (with one engine in all, its death does at once)."""
    frontend_budget = config.frontends.restarts
    restarts = RestartBudget(frontend_budget.max_restarts, frontend_budget.window_s)
    engine_restarts = None
    if num_engines > 1:
        engine_budget = config.engines.restarts
        engine_restarts = RestartBudget(engine_budget.max_restarts, engine_budget.window_s)
    return watch(children, restarts, engine_restarts, config.engines.ready_timeout_s, listening)


def start_frontends(
    frontends: FrontendsConfig,
    addresses: list[str],
    runtime_dir: Path,
    children: dict[str, ChildProcess],
    listening: ListeningSockets,
) -> None:
    """Start every frontend on its socket of ``listening`` (the port, bound before the engines
    started), then wait for each: they load their tokenizers in parallel."""
    # By the environment, which, unlike a command line, other users cannot read.
    env = api_key_env(frontends.api_keys)
    # One store for all: a response kept by one frontend is found through any.
    env[RESPONSES_DIR_ENV] = str(make_responses_dir(runtime_dir))
    metrics_dir = None
    if frontends.metrics:
        # One folder for all: a scrape of any frontend reports the whole server.
        metrics_dir = make_shared_dir(runtime_dir)
        env[MULTIPROC_DIR_ENV] = str(metrics_dir)
    options = list(frontends.options)
    started = []
    for index in range(frontends.count):
        frontend = FrontendProcess(
            index, addresses, options, runtime_dir, env, metrics_dir, listening.fileno(index)
        )
        children[f"frontend-{index}"] = frontend
        started.append(frontend.start())
    deadline = time.monotonic() + frontends.ready_timeout_s
    for frontend in started:
        frontend.wait_ready(max(deadline - time.monotonic(), 0.0))
    remaining_s = max(deadline - time.monotonic(), 1.0)
    wait_healthy(frontends.host, frontends.port, remaining_s, frontends.http.scheme)
