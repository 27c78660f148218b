"""``conveyor serve``'s configuration: one frozen tree, built once from the parsed command line.

Runs in the supervisor (``conveyor serve``). ``serve.parse_args`` checks the flags one by one;
``ServeConfig.from_args`` then resolves everything the processes need (the model named either
way, the served name, the API key, the engine's ``EngineConfig``, the data-parallel layout, the
frontends' own flags) so that nothing downstream reads the namespace, and nothing changes it.
Each part goes only where it is used: the engines' part to ``launch``/``engines``, the frontends'
to ``start_frontends``, the hosts' to ``dp_hosts``/``headless``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

from conveyor.entrypoints.dp_hosts import DataParallelLayout
from conveyor.frontend.engine_args import DEFAULT_SERVED_MODEL_NAME, EngineArgs
from conveyor.frontend.server.http_options import HttpOptions, http_flags
from conveyor.frontend.server.lora_modules import lora_module_options
from conveyor.frontend.server.main import (
    engine_session_options,
    observability_options,
    resolve_api_keys,
    responses_store_options,
    router_options,
)
from conveyor.protocol import EngineConfig


@dataclass(frozen=True)
class RestartBudgetConfig:
    """At most ``max_restarts`` restarts within ``window_s``; one more death stops everything."""

    max_restarts: int
    window_s: float


@dataclass(frozen=True)
class EnginesConfig:
    """This host's engine cores: what they run and how they are started and watched."""

    engine: EngineConfig
    executor_backend: str | None
    # Where engine 0 listens (None: a private ipc:// folder); the others' follow from it.
    address: str | None
    allow_remote_clients: bool
    heartbeat_timeout_s: float | None
    ready_timeout_s: float
    # Only with several data-parallel engines: one engine's death always stops everything.
    restarts: RestartBudgetConfig


@dataclass(frozen=True)
class FrontendsConfig:
    """The HTTP frontends: how many, where, and the flags each process gets."""

    count: int
    host: str
    port: int
    # Every name the API takes for the model; the first is the one responses carry.
    served_model_names: tuple[str, ...]
    # Any of them is accepted; they travel to the frontends by the environment, never on a
    # command line.
    api_keys: tuple[str, ...] = field(repr=False)
    # TLS, CORS, the root path, uvicorn's log level, X-Request-Id headers.
    http: HttpOptions
    # ``python -m conveyor.frontend`` flags every frontend gets (besides its engines).
    options: tuple[str, ...]
    metrics: bool
    ready_timeout_s: float
    drain_timeout_s: float
    restarts: RestartBudgetConfig
    demo_prompt: str | None

    @property
    def served_model_name(self) -> str:
        return self.served_model_names[0]


@dataclass(frozen=True)
class HostsConfig:
    """Several hosts: this one's role, its data-parallel ranks and its CURVE keys."""

    headless: bool
    # None on a host that runs tensor-parallel ranks only (``--headless --nnodes N``).
    data_parallel: DataParallelLayout | None
    # An absolute path, exported to every child as $CONVEYOR_CURVE_KEYS; None: as inherited.
    curve_keys_dir: str | None


@dataclass(frozen=True)
class ServeConfig:
    # The model as the user named it (None: the embedded default); for the logs.
    model: str | None
    engines: EnginesConfig
    frontends: FrontendsConfig
    hosts: HostsConfig
    stop_timeout_s: float
    log_level: str | None

    @property
    def runs_tensor_parallel_ranks_only(self) -> bool:
        """``--headless --nnodes N``: this host runs another host's engine's worker ranks."""
        return self.hosts.headless and self.engines.engine.parallel.nodes.nnodes > 1

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeConfig:
        """Everything the flags say, resolved once. Raises ``ConfigError`` for a model or a
        layout that cannot be served, ``SystemExit`` for an unreadable --api-key-file."""
        model = args.model_tag if args.model_tag is not None else args.model
        engine_args = dataclasses.replace(EngineArgs.from_cli(args), model=model)
        engine = engine_args.create_engine_config()
        engines = EnginesConfig(
            engine=engine,
            executor_backend=args.executor_backend,
            address=args.address,
            allow_remote_clients=args.allow_remote_clients,
            heartbeat_timeout_s=args.heartbeat_timeout_s,
            ready_timeout_s=args.ready_timeout_s,
            restarts=RestartBudgetConfig(args.engine_max_restarts, args.engine_restart_window_s),
        )
        names = tuple(args.served_model_name or (model or DEFAULT_SERVED_MODEL_NAME,))
        frontends = FrontendsConfig(
            count=args.frontends,
            host=args.host,
            port=args.port,
            served_model_names=names,
            api_keys=resolve_api_keys(args),
            http=args.http,
            options=tuple(_frontend_options(args, names)),
            metrics=not args.disable_metrics,
            ready_timeout_s=args.frontend_ready_timeout_s,
            drain_timeout_s=args.drain_timeout_s,
            restarts=RestartBudgetConfig(
                args.frontend_max_restarts, args.frontend_restart_window_s
            ),
            demo_prompt=args.demo_prompt,
        )
        headless = args.headless
        layout = None
        if not (headless and engine.parallel.nodes.nnodes > 1):
            size = engine.parallel.data_parallel_size
            local = size if args.data_parallel_size_local is None else args.data_parallel_size_local
            layout = DataParallelLayout(
                size,
                local,
                args.data_parallel_start_rank,
                args.data_parallel_address,
                args.data_parallel_rpc_port,
            )
            layout.check(headless=headless)
        keys_dir = args.curve_keys and os.path.abspath(os.path.expanduser(args.curve_keys))
        hosts = HostsConfig(headless, layout, keys_dir or None)
        return cls(model, engines, frontends, hosts, args.stop_timeout_s, args.log_level)


def _frontend_options(args: argparse.Namespace, served_model_names: tuple[str, ...]) -> list[str]:
    """The ``python -m conveyor.frontend`` flags every frontend gets (the API keys travel by
    env)."""
    options = ["--host", args.host, "--port", str(args.port)]
    options += ["--served-model-name", *served_model_names]
    options += ["--drain-timeout-s", str(args.drain_timeout_s)]
    if args.max_queued_requests is not None:
        options += ["--max-queued-requests", str(args.max_queued_requests)]
    if args.max_request_body_bytes is not None:
        options += ["--max-request-body-bytes", str(args.max_request_body_bytes)]
    options += ["--request-read-timeout-s", str(args.request_read_timeout_s)]
    options += ["--keep-alive-timeout-s", str(args.keep_alive_timeout_s)]
    options += ["--max-header-bytes", str(args.max_header_bytes)]
    options += router_options(args)
    options += engine_session_options(args)
    options += observability_options(args)
    options += responses_store_options(args)
    options += http_flags(args.http)
    options += lora_module_options(args)
    return options
