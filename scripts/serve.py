"""The supervisor: start the engine core (which starts its workers) and the HTTP frontends; watch.

    python scripts/serve.py [--model DIR] [--frontends N] [--port 8000] [engine args...]

Runs as the supervisor process, the parent of every conveyor process. It prints
``ready: engine_core pid=PID address=ADDRESS`` once the engine answers clients at ADDRESS (attach
with ``MPEngineClient(address=...)``, ``AsyncEngineClient.start(address=...)`` or
``python -m frontend --engine ADDRESS``), then starts N OpenAI-compatible HTTP frontends sharing
one port and prints ``ready: http://HOST:PORT`` once each of them serves. Then it watches its
children: a dead frontend is restarted (it holds no state; the engine aborts its requests when its
heartbeat stops), unless frontends died more than --frontend-max-restarts times within
--frontend-restart-window-s; the engine core's death, or a spent restart budget, stops everything
and exits 1. SIGTERM or SIGINT stops all of them gracefully (frontends drain first, for up to
--drain-timeout-s; SIGTERM, then SIGKILL after --stop-timeout-s) and exits 0. Children watch their
parent, so even a SIGKILLed supervisor leaves no orphans. Without --model it serves the embedded
tiny default model; ``--frontends 0`` runs the engine alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Protocol

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from frontend.engine_args import EngineArgs, add_engine_args  # noqa: E402
from frontend.engine_process import EngineProcess, private_runtime_dir  # noqa: E402
from frontend.engine_session import (  # noqa: E402
    DEFAULT_READY_TIMEOUT_S,
    HEARTBEAT_INTERVAL_S,
    EngineStartError,
)
from frontend.frontend_process import (  # noqa: E402
    FrontendProcess,
    FrontendStartError,
    RestartBudget,
)
from protocol import ConfigError  # noqa: E402

logger = logging.getLogger("serve")

LOG_FORMAT = "%(asctime)s serve[%(process)d] %(levelname)s %(name)s: %(message)s"
_WATCH_INTERVAL_S = 0.2
DEFAULT_SERVED_MODEL_NAME = "conveyor-tiny"
API_KEY_ENV = "CONVEYOR_API_KEY"


class Child(Protocol):
    pid: int

    def exit_code(self) -> int | None: ...

    def stop(self, timeout_s: float) -> int | None: ...


class StopRequested(BaseException):
    """SIGTERM/SIGINT: stop everything and exit 0 (a BaseException: no ``except Exception``
    in the start-up path may swallow it)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--address",
        default=None,
        help="where the engine listens: ipc://PATH (default: a private folder) or "
        "tcp://127.0.0.1:PORT; another host only if you mean it (no authentication)",
    )
    parser.add_argument(
        "--allow-remote-clients",
        action="store_true",
        help="let the engine bind a tcp address other hosts can reach",
    )
    parser.add_argument("--executor-backend", choices=("mp", "inprocess"), default=None)
    parser.add_argument("--heartbeat-timeout-s", type=float, default=None)
    parser.add_argument("--ready-timeout-s", type=float, default=DEFAULT_READY_TIMEOUT_S)
    parser.add_argument("--stop-timeout-s", type=float, default=10.0)
    add_frontend_args(parser)
    add_engine_args(parser)
    args = parser.parse_args(argv)
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
    for name in ("max_queued_requests", "max_request_body_bytes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.frontends and not 0 < args.port < 65536:
        # Port 0 would give every frontend its own random port: they must share one.
        parser.error(f"--port must be in [1, 65535], got {args.port}")
    return args


def add_frontend_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("HTTP frontends")
    group.add_argument("--frontends", type=int, default=1, help="HTTP frontend processes (0: none)")
    group.add_argument("--host", default="127.0.0.1", help="interface the frontends listen on")
    group.add_argument("--port", type=int, default=8000, help="the port every frontend shares")
    group.add_argument(
        "--api-key", default=None, help=f"require this bearer key on /v1/* (or ${API_KEY_ENV})"
    )
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
    group.add_argument(
        "--demo-prompt",
        default=None,
        metavar="TEXT",
        help="once serving, send this prompt through the HTTP API, print the completion and "
        "a curl command, then go on serving",
    )


def frontend_options(args: argparse.Namespace) -> list[str]:
    """The ``python -m frontend`` flags every frontend gets (the API key travels by env)."""
    name = args.served_model_name or args.model
    options = ["--host", args.host, "--port", str(args.port), "--served-model-name", name]
    options += ["--drain-timeout-s", str(args.drain_timeout_s)]
    if args.max_queued_requests is not None:
        options += ["--max-queued-requests", str(args.max_queued_requests)]
    if args.max_request_body_bytes is not None:
        options += ["--max-request-body-bytes", str(args.max_request_body_bytes)]
    return options


# A signal that arrives while a child is being spawned waits here until the spawn is done.
_spawning = False
_deferred_stop: str | None = None


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    global _deferred_stop
    # Later signals are ignored, so stopping the children cannot itself be interrupted.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if _spawning:
        _deferred_stop = signal.Signals(signum).name
        return
    raise StopRequested(signal.Signals(signum).name)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Spawn a child with no StopRequested inside ``Popen``.

    Raised there after the fork, it would lose the child's handle: the child would run on
    unknown to ``stop_all`` (and the half-built handle once failed an assertion on the way out).
    The signal is raised as soon as the spawn is done instead.
    """
    global _spawning
    _spawning = True
    try:
        yield
    finally:
        _spawning = False
    if _deferred_stop is not None:
        raise StopRequested(_deferred_stop)


def watch(children: dict[str, Child], restarts: RestartBudget) -> str:
    """Block until a child's death must stop everything; returns what happened to it.

    A dead frontend is restarted in place while ``restarts`` allows it; the others keep serving.
    """
    restarting: set[str] = set()
    while True:
        for name, child in children.items():
            code = child.exit_code()
            if code is None:
                if name in restarting and isinstance(child, FrontendProcess) and child.is_ready():
                    restarting.discard(name)
                    logger.info("%s serves again (pid %d)", name, child.pid)
                continue
            death = f"{name} (pid {child.pid}) exited with code {code}"
            if not isinstance(child, FrontendProcess):
                return death
            if not restarts.take():
                return (
                    f"{death}, more than {restarts.max_restarts} frontend restarts within "
                    f"{restarts.window_s:g} s"
                )
            logger.warning(
                "%s; restarting it (restart %d of at most %d within %g s)",
                death,
                restarts.num_recent,
                restarts.max_restarts,
                restarts.window_s,
            )
            with signals_deferred():
                child.start()
            restarting.add(name)
        time.sleep(_WATCH_INTERVAL_S)


def serve(args: argparse.Namespace) -> int:
    try:
        config = EngineArgs.from_cli(args).create_engine_config()
    except ConfigError as exc:
        logger.error("%s", exc)
        return 2
    engine = EngineProcess(
        config,
        args.executor_backend,
        args.heartbeat_timeout_s,
        address=args.address,
        allow_remote_clients=args.allow_remote_clients,
    )
    # Registered before it starts: a signal at any point below still stops it.
    children: dict[str, Child] = {"engine_core": engine}
    runtime_dir = private_runtime_dir()
    try:
        with signals_deferred():
            engine.start()
        served = engine.wait_ready(args.ready_timeout_s)
        logger.info("engine core serves %s with %d KV blocks", args.model, served.cache.num_blocks)
        print(f"ready: engine_core pid={engine.pid} address={engine.address}", flush=True)
        # Frontends start only now, so they never talk to an engine still loading.
        if args.frontends:
            start_frontends(args, engine.address, runtime_dir, children)
            print(f"ready: http://{args.host}:{args.port}", flush=True)
            if args.demo_prompt is not None:
                show_completion(args, args.demo_prompt)
        restarts = RestartBudget(args.frontend_max_restarts, args.frontend_restart_window_s)
        logger.error("%s; stopping everything", watch(children, restarts))
        return 1
    except StopRequested as signal_name:
        logger.info("%s: stopping everything", signal_name)
        return 0
    except (EngineStartError, FrontendStartError) as exc:
        logger.error("%s", exc)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop_all(children, args.stop_timeout_s, args.drain_timeout_s)
        shutil.rmtree(runtime_dir, ignore_errors=True)


def start_frontends(
    args: argparse.Namespace, address: str, runtime_dir: Path, children: dict[str, Child]
) -> None:
    """Start every frontend, then wait for each: they load their tokenizers in parallel."""
    api_key = args.api_key or os.environ.get(API_KEY_ENV)
    env = {API_KEY_ENV: api_key} if api_key else {}
    frontends = []
    for index in range(args.frontends):
        frontend = FrontendProcess(index, address, frontend_options(args), runtime_dir, env)
        children[f"frontend-{index}"] = frontend
        with signals_deferred():
            frontends.append(frontend.start())
    deadline = time.monotonic() + args.frontend_ready_timeout_s
    for frontend in frontends:
        frontend.wait_ready(max(deadline - time.monotonic(), 0.0))
    wait_healthy(args.host, args.port, max(deadline - time.monotonic(), 1.0))


def wait_healthy(host: str, port: int, timeout_s: float) -> None:
    """Poll GET /health on the shared port until it answers 200."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    url = f"http://[{host}]:{port}/health" if ":" in host else f"http://{host}:{port}/health"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2.0) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise FrontendStartError(f"{url} did not answer 200 within {timeout_s:.0f} s")
        time.sleep(0.1)


def show_completion(args: argparse.Namespace, prompt: str) -> None:
    """One greedy completion through our own HTTP API: proof that the whole path serves."""
    host = "127.0.0.1" if args.host in ("0.0.0.0", "") else args.host
    url = f"http://{host}:{args.port}/v1/completions"
    model = args.served_model_name or args.model
    body = {"model": model, "prompt": prompt, "max_tokens": 32, "temperature": 0}
    headers = {"Content-Type": "application/json"}
    api_key = args.api_key or os.environ.get(API_KEY_ENV)
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=60.0) as response:
            result = json.load(response)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        # The demo is a courtesy: a failure is reported, the server keeps serving.
        logger.error("the demo completion failed: %s", exc)
        return
    choice = result["choices"][0]
    print(f"completion ({choice['finish_reason']}): {prompt!r} -> {choice['text']!r}", flush=True)
    curl_body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 32})
    print(
        f"try: curl {url} -H 'Content-Type: application/json' -d '{curl_body}'\n"
        "serving until Ctrl-C",
        flush=True,
    )


def stop_all(children: dict[str, Child], timeout_s: float, drain_timeout_s: float = 0.0) -> None:
    """Frontends first, all draining at once, then the engine they were streaming from."""
    frontends = [c for c in children.values() if isinstance(c, FrontendProcess)]
    for frontend in frontends:
        frontend.request_stop()
    # A frontend's drain is no reason to SIGKILL it: it gets the drain on top of the timeout.
    for frontend in frontends:
        frontend.stop(timeout_s + drain_timeout_s)
    for child in children.values():
        if child not in frontends:
            child.stop(timeout_s)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    # Installed before anything starts, so no signal can leave a half-started child behind.
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    try:
        args = parse_args(argv)
        if args.model is None:
            args.served_model_name = args.served_model_name or DEFAULT_SERVED_MODEL_NAME
            args.model = str(default_model())
        return serve(args)
    except StopRequested:
        return 0


def default_model() -> Path:
    # A script may import the worker package; the model is generated once and cached.
    from worker.model_maker import ensure_default_model

    return ensure_default_model()


if __name__ == "__main__":
    sys.exit(main())
