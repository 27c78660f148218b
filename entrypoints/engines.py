"""The engine cores a supervisor runs: one per data-parallel rank of this host, and where each
listens.

Runs in the supervisor (``conveyor serve``, headless or not). Engine i is its own process (with its
own tensor-parallel workers and KV pool) serving ``config`` with ``data_parallel_rank=i``; the
frontends get every engine's address in rank order. This module is the one place those addresses
are made: on the head, ``engine_address(base, i, size)`` (a private ipc folder each by default);
on another host (``--headless``), ``remote_engine_address``: the data-parallel rpc port + i on
the interface that faces the head, which announces it to the head (``dp_hosts``).

With one engine nothing changes from before: it is ``engine_core``, and its death stops the
server. With several, engine i is ``engine_core-i`` and is started again in place (same address,
same folder) when it dies, within a restart budget, while the others serve on; with
``--executor-backend ray`` each is a Ray actor in a placement group (``ray_engines``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import PurePosixPath

from msgspec.structs import replace

from conveyor.frontend.engine_client import EngineProcess, EngineStartError
from conveyor.protocol import EngineConfig

logger = logging.getLogger(__name__)


def engine_name(rank: int, size: int) -> str:
    return "engine_core" if size == 1 else f"engine_core-{rank}"


def engine_address(base: str | None, rank: int, size: int) -> str | None:
    """Engine ``rank``'s address from ``--address``: None (a private ipc folder each, the
    default), the address itself with one engine; with several, tcp ports count up from the one
    given and ipc paths get ``-RANK`` before their suffix."""
    if base is None or size == 1:
        return base
    if base.startswith("ipc://"):
        path = PurePosixPath(base.removeprefix("ipc://"))
        return f"ipc://{path.with_name(f'{path.stem}-{rank}{path.suffix}')}"
    if base.startswith("tcp://"):
        host, _, port = base.removeprefix("tcp://").rpartition(":")
        if port.isdigit() and int(port) > 0:
            return f"tcp://{host}:{int(port) + rank}"
    return base  # let the engine refuse it, with its own message


def remote_engine_address(host: str, rpc_port: int, rank: int) -> str:
    """Where data-parallel engine ``rank`` on a host other than the head listens: the rpc port
    plus its rank (the head's own rpc port, rank 0's, is where engines announce themselves)."""
    return f"tcp://{host}:{rpc_port + rank}"


def local_engine_addresses(base: str | None, ranks: range, size: int) -> dict[int, str | None]:
    """The head's engines: rank -> address from ``--address`` (None: a private ipc folder)."""
    return {rank: engine_address(base, rank, size) for rank in ranks}


def make_engines(
    config: EngineConfig,
    executor_backend: str | None,
    heartbeat_timeout_s: float | None,
    addresses: dict[int, str | None],
    allow_remote_clients: bool,
) -> list[EngineProcess]:
    """One (unstarted) engine process per data-parallel rank in ``addresses`` (this host's)."""
    size = config.parallel.data_parallel_size
    make_engine: Callable[..., EngineProcess] = EngineProcess
    if executor_backend == "ray" and size > 1:
        # Ray places the engine cores too (an optional extra: imported only when asked for).
        from conveyor.entrypoints.ray_engines import RayEnginePlacement

        make_engine = RayEnginePlacement(len(addresses)).engine
    engines = []
    for rank, address in addresses.items():
        parallel = replace(config.parallel, data_parallel_rank=rank)
        engine = make_engine(
            replace(config, parallel=parallel),
            executor_backend,
            heartbeat_timeout_s,
            address=address,
            allow_remote_clients=allow_remote_clients,
            name=engine_name(rank, size),
            restartable=size > 1,
        )
        engines.append(engine)
    return engines


def start_engines(engines: list[EngineProcess], timeout_s: float) -> list[EngineConfig]:
    """Start every engine, then wait for each: they load their models side by side."""
    for engine in engines:
        engine.start()
    return [engine.wait_ready(timeout_s) for engine in engines]


def restart_engine(engine: EngineProcess, timeout_s: float) -> None:
    """Start a dead engine again in place; a thread logs when it serves (the frontends attach
    to it again on their own)."""
    engine.start()
    threading.Thread(
        target=_log_when_ready, args=(engine, timeout_s), name="engine-restart", daemon=True
    ).start()


def _log_when_ready(engine: EngineProcess, timeout_s: float) -> None:
    try:
        engine.wait_ready(timeout_s, stop_on_failure=False)
    except EngineStartError as exc:
        # Its exit (if it exited) is the watcher's to act on.
        logger.warning("%s did not serve again: %s", engine.name, exc)
        return
    logger.info("%s serves again (pid %d) at %s", engine.name, engine.pid, engine.address)
