"""``conveyor serve [MODEL]``: the supervisor. Start the engine core (which starts its workers) and
the HTTP frontends; watch them.

    conveyor serve [MODEL] [--frontends N] [--port 8000] [engine args...]

Runs as the supervisor process, the parent of every conveyor process. It prints
``ready: engine_core pid=PID address=ADDRESS`` once the engine answers clients at ADDRESS (attach
with ``MPEngineClient(address=...)``, ``AsyncEngineClient.start(address=...)`` or
``conveyor frontend --engine ADDRESS``), then starts N OpenAI-compatible HTTP frontends sharing
one port and prints ``ready: http://HOST:PORT`` once each of them serves. Then it watches its
children: a dead frontend is restarted (it holds no state; the engine aborts its requests when its
heartbeat stops), unless frontends died more than --frontend-max-restarts times within
--frontend-restart-window-s; the engine core's death, or a spent restart budget, stops everything
and exits 1. With ``--data-parallel-size N`` it runs N engine cores (``engine_core-0`` ...,
one ready line each; every frontend is a client of all of them and routes each request,
--router), and a dead one is restarted in place (--engine-max-restarts within
--engine-restart-window-s) while the others serve. SIGTERM or SIGINT stops all of them
gracefully (frontends drain first, for up to --drain-timeout-s; SIGTERM, then SIGKILL after
--stop-timeout-s) and exits 0. Children watch their parent, so even a SIGKILLed supervisor leaves
no orphans. MODEL (or ``--model``) is a local
Hugging Face model directory or an id found in the local Hugging Face cache (nothing is
downloaded); without one it serves the embedded default model. ``--frontends 0``
runs the engine alone.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from entrypoints.engine import EXECUTOR_BACKENDS
from entrypoints.engines import make_engines, start_engines
from entrypoints.headless import add_multi_host_args, check_multi_host_args, run_headless
from entrypoints.supervisor import (
    FrontendProcess,
    FrontendStartError,
    RestartBudget,
    base_url,
    stop_all,
    wait_healthy,
    watch,
)
from frontend.engine_args import (
    DEFAULT_SERVED_MODEL_NAME,
    EngineArgs,
    add_engine_args,
)
from frontend.engine_client import EngineStartError
from frontend.engine_client.session import DEFAULT_READY_TIMEOUT_S, HEARTBEAT_INTERVAL_S
from frontend.server.main import (
    API_KEY_ENV,
    add_api_key_args,
    add_connection_args,
    add_observability_args,
    add_router_args,
    check_observability_args,
    observability_options,
    resolve_api_key,
    router_options,
)
from frontend.server.metrics_dir import MULTIPROC_DIR_ENV, make_shared_dir
from protocol import ConfigError
from runtime.exit_codes import ExitCode
from runtime.logs import LOG_LEVEL_ENV, configure_logging
from runtime.processes import ChildProcess
from runtime.signals import ShutdownRequested, ignore_shutdown_signals, install_shutdown_signals

logger = logging.getLogger("serve")

DEMO_MAX_TOKENS = 48


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="conveyor serve",
        description="Serve a model over an OpenAI-compatible HTTP API: the engine core, its "
        "workers and N HTTP frontends, supervised.",
    )
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="a local Hugging Face model directory or an id (org/name) in the local Hugging Face "
        "cache (same as --model; default: the embedded model)",
    )
    parser.add_argument(
        "--address",
        default=None,
        help="where the engine listens: ipc://PATH (default: a private folder) or "
        "tcp://127.0.0.1:PORT; another host only with --allow-remote-clients and --curve-keys",
    )
    parser.add_argument(
        "--allow-remote-clients",
        action="store_true",
        help="let the engine bind a tcp address other hosts can reach (needs --curve-keys)",
    )
    parser.add_argument(
        "--executor-backend", "--distributed-executor-backend", choices=EXECUTOR_BACKENDS
    )
    parser.add_argument(
        "--engine-max-restarts",
        type=int,
        default=5,
        help="with --data-parallel-size > 1: restart a dead engine at most this often within "
        "--engine-restart-window-s (the others serve meanwhile); one more death stops "
        "everything. With one engine, its death always stops everything",
    )
    parser.add_argument("--engine-restart-window-s", type=float, default=60.0)
    parser.add_argument("--heartbeat-timeout-s", type=float, default=None)
    parser.add_argument("--ready-timeout-s", type=float, default=DEFAULT_READY_TIMEOUT_S)
    parser.add_argument("--stop-timeout-s", type=float, default=10.0)
    parser.add_argument(
        "--log-level", default=None, help="every process's log level (default: INFO)"
    )
    add_frontend_args(parser)
    add_multi_host_args(parser)
    add_engine_args(parser)
    args = parser.parse_args(argv)
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            parser.error(f"MODEL {args.model_tag!r} and --model {args.model!r} disagree")
        args.model = args.model_tag
    if args.frontends < 0:
        parser.error(f"--frontends must be >= 0, got {args.frontends}")
    if (
        args.heartbeat_timeout_s is not None
        and args.heartbeat_timeout_s < 1.5 * HEARTBEAT_INTERVAL_S
    ):
        # Below that, a healthy idle client (a frontend) would be dropped between two heartbeats.
        parser.error(
            f"--heartbeat-timeout-s must be at least {1.5 * HEARTBEAT_INTERVAL_S:g} (clients "
            f"heartbeat every {HEARTBEAT_INTERVAL_S:g} s), got {args.heartbeat_timeout_s:g}"
        )
    if args.frontend_max_restarts < 0 or args.drain_timeout_s < 0:
        parser.error("--frontend-max-restarts and --drain-timeout-s must be >= 0")
    if args.engine_max_restarts < 0:
        parser.error(f"--engine-max-restarts must be >= 0, got {args.engine_max_restarts}")
    for name in ("max_queued_requests", "max_request_body_bytes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    check_observability_args(parser, args)
    set_frontend_flags = [f for f in observability_options(args) if f != "--disable-metrics"]
    if not args.frontends and set_frontend_flags:
        parser.error(f"{' '.join(set_frontend_flags)}: there are no frontends (--frontends 0)")
    if args.frontends and not 0 < args.port < 65536:
        # Port 0 would give every frontend its own random port: they must share one.
        parser.error(f"--port must be in [1, 65535], got {args.port}")
    return args


def add_frontend_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("HTTP frontends")
    group.add_argument("--frontends", type=int, default=1, help="HTTP frontend processes (0: none)")
    group.add_argument("--host", default="127.0.0.1", help="interface the frontends listen on")
    group.add_argument("--port", type=int, default=8000, help="the port every frontend shares")
    add_api_key_args(group)
    group.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="per frontend: 429 while this many generation requests are in flight",
    )
    group.add_argument(
        "--served-model-name",
        default=None,
        help=f"the model's name in the API (default: --model, or {DEFAULT_SERVED_MODEL_NAME})",
    )
    group.add_argument("--max-request-body-bytes", type=int, default=None)
    add_router_args(group)
    add_connection_args(group)
    group.add_argument("--frontend-ready-timeout-s", type=float, default=60.0)
    group.add_argument(
        "--drain-timeout-s",
        type=float,
        default=5.0,
        help="on SIGTERM: how long in-flight requests may run on before they are aborted",
    )
    group.add_argument(
        "--frontend-max-restarts",
        type=int,
        default=5,
        help="restart a dead frontend at most this often within --frontend-restart-window-s; "
        "one more death stops everything (0: any frontend death stops everything)",
    )
    group.add_argument("--frontend-restart-window-s", type=float, default=60.0)
    add_observability_args(group)
    group.add_argument(
        "--demo-prompt",
        default=None,
        metavar="TEXT",
        help="once serving, send this prompt through the HTTP API, print the completion and "
        "a curl command, then go on serving",
    )


def frontend_options(args: argparse.Namespace) -> list[str]:
    """The ``python -m frontend`` flags every frontend gets (the API key travels by env)."""
    options = ["--host", args.host, "--port", str(args.port)]
    options += ["--served-model-name", args.served_model_name]
    options += ["--drain-timeout-s", str(args.drain_timeout_s)]
    if args.max_queued_requests is not None:
        options += ["--max-queued-requests", str(args.max_queued_requests)]
    if args.max_request_body_bytes is not None:
        options += ["--max-request-body-bytes", str(args.max_request_body_bytes)]
    options += ["--request-read-timeout-s", str(args.request_read_timeout_s)]
    options += ["--keep-alive-timeout-s", str(args.keep_alive_timeout_s)]
    options += ["--max-header-bytes", str(args.max_header_bytes)]
    options += router_options(args)
    options += observability_options(args)
    return options


def serve(args: argparse.Namespace) -> int:
    try:
        config = EngineArgs.from_cli(args).create_engine_config()
    except ConfigError as exc:
        logger.error("%s", exc)
        return ExitCode.BAD_CONFIG
    engines = make_engines(
        config,
        args.executor_backend,
        args.heartbeat_timeout_s,
        args.address,
        args.allow_remote_clients,
    )
    # Registered before they start: a signal at any point below still stops them.
    children: dict[str, ChildProcess] = {engine.name: engine for engine in engines}
    # The frontends' ready files go beside engine 0's socket: the engine removes the folder
    # when it exits, so nothing is left even when this process is SIGKILLed.
    runtime_dir = engines[0].runtime_dir
    try:
        served = start_engines(engines, args.ready_timeout_s)
        for engine, engine_config in zip(engines, served):
            blocks = engine_config.cache.num_blocks
            logger.info("%s serves %s with %d KV blocks", engine.name, args.model, blocks)
            print(f"ready: {engine.name} pid={engine.pid} address={engine.address}", flush=True)
        # Frontends start only now, so they never talk to an engine still loading.
        addresses = [engine.address for engine in engines]
        if args.frontends:
            start_frontends(args, addresses, runtime_dir, children)
            print(f"ready: http://{args.host}:{args.port}", flush=True)
            if args.demo_prompt is not None:
                show_completion(args, args.demo_prompt)
        logger.error("%s; stopping everything", watch_children(args, children, len(engines)))
        return ExitCode.FAILED
    except ShutdownRequested as signal_name:
        logger.info("%s: stopping everything", signal_name)
        return ExitCode.OK
    except (EngineStartError, FrontendStartError) as exc:
        logger.error("%s", exc)
        return ExitCode.FAILED
    finally:
        ignore_shutdown_signals()  # stopping the children must not itself be interrupted
        stop_all(children, args.stop_timeout_s, args.drain_timeout_s)


def watch_children(
    args: argparse.Namespace, children: dict[str, ChildProcess], num_engines: int
) -> str:
    """Watch until a death stops everything (with one engine, its death does at once)."""
    restarts = RestartBudget(args.frontend_max_restarts, args.frontend_restart_window_s)
    engine_restarts = None
    if num_engines > 1:
        engine_restarts = RestartBudget(args.engine_max_restarts, args.engine_restart_window_s)
    return watch(children, restarts, engine_restarts, args.ready_timeout_s)


def start_frontends(
    args: argparse.Namespace,
    addresses: list[str],
    runtime_dir: Path,
    children: dict[str, ChildProcess],
) -> None:
    """Start every frontend, then wait for each: they load their tokenizers in parallel."""
    # By the environment, which, unlike a command line, other users cannot read.
    env = {API_KEY_ENV: args.resolved_api_key} if args.resolved_api_key else {}
    metrics_dir = None
    if not args.disable_metrics:
        # One folder for all: a scrape of any frontend reports the whole server.
        metrics_dir = make_shared_dir(runtime_dir)
        env[MULTIPROC_DIR_ENV] = str(metrics_dir)
    frontends = []
    for index in range(args.frontends):
        frontend = FrontendProcess(
            index, addresses, frontend_options(args), runtime_dir, env, metrics_dir
        )
        children[f"frontend-{index}"] = frontend
        frontends.append(frontend.start())
    deadline = time.monotonic() + args.frontend_ready_timeout_s
    for frontend in frontends:
        frontend.wait_ready(max(deadline - time.monotonic(), 0.0))
    wait_healthy(args.host, args.port, max(deadline - time.monotonic(), 1.0))


def demo_body(args: argparse.Namespace, prompt: str) -> dict[str, object]:
    """A greedy completion request; the server adds the model's own defaults for the rest (the
    embedded model's repetition penalty: greedy decoding of a small model loops)."""
    body: dict[str, object] = {"model": args.served_model_name, "prompt": prompt}
    body.update(max_tokens=DEMO_MAX_TOKENS, temperature=0)
    return body


def show_completion(args: argparse.Namespace, prompt: str) -> None:
    """One greedy completion through our own HTTP API: proof that the whole path serves."""
    url = f"{base_url(args.host, args.port)}/v1/completions"
    body = demo_body(args, prompt)
    headers = {"Content-Type": "application/json"}
    if args.resolved_api_key:
        headers["Authorization"] = f"Bearer {args.resolved_api_key}"
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=60.0) as response:
            result = json.load(response)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        # The demo is a courtesy: a failure is reported, the server keeps serving.
        logger.error("the demo completion failed: %s", exc)
        return
    choice = result["choices"][0]
    print(f"completion ({choice['finish_reason']}):\n{prompt}{choice['text']}\n", flush=True)
    curl_body = json.dumps(body)
    print(
        f"try: curl {url} -H 'Content-Type: application/json' -d {shlex.quote(curl_body)}\n"
        "serving until Ctrl-C",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    # Installed before anything starts, so no signal can leave a half-started child behind.
    install_shutdown_signals()
    try:
        args = parse_args(argv)
        configure_logging("serve", args.log_level)
        args.resolved_api_key = resolve_api_key(args)
        if args.log_level:
            # Every child reads the level from the environment it inherits.
            os.environ[LOG_LEVEL_ENV] = args.log_level
        if args.served_model_name is None:
            args.served_model_name = args.model or DEFAULT_SERVED_MODEL_NAME
        refused = check_multi_host_args(args)
        if refused is not None:
            return refused
        return run_headless(args) if args.headless else serve(args)
    except ShutdownRequested:
        return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
