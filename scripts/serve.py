"""The supervisor: start the engine core (which starts its workers), wait until it serves, watch.

    python scripts/serve.py --model DIR [--tensor-parallel-size N] [engine args...]

Runs as the supervisor process, the parent of every conveyor process. It prints one line,
``ready: engine_core pid=PID address=ADDRESS``, once the engine answers clients at ADDRESS (attach
with ``MPEngineClient(address=...)`` or ``AsyncEngineClient.start(address=...)``). Then it watches
its children: any death stops all of them and exits 1; SIGTERM or SIGINT stops all of them
gracefully (SIGTERM, then SIGKILL after --stop-timeout-s) and exits 0. Children watch their
parent, so even a SIGKILLed supervisor leaves no orphans.

HTTP frontends come later: ``--frontends N`` is the hook where they will start (after READY,
beside the engine, watched like it); today it is refused.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from pathlib import Path
from types import FrameType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from frontend.engine_args import EngineArgs, add_engine_args  # noqa: E402
from frontend.engine_process import EngineProcess  # noqa: E402
from frontend.engine_session import DEFAULT_READY_TIMEOUT_S, EngineStartError  # noqa: E402
from protocol import ConfigError  # noqa: E402

logger = logging.getLogger("serve")

LOG_FORMAT = "%(asctime)s serve[%(process)d] %(levelname)s %(name)s: %(message)s"
_WATCH_INTERVAL_S = 0.2


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
    parser.add_argument(
        "--frontends", type=int, default=0, help="HTTP frontends to start (not available yet)"
    )
    add_engine_args(parser)
    args = parser.parse_args(argv)
    if args.frontends:
        parser.error(
            "--frontends: the HTTP frontend is not available yet; attach clients by address"
        )
    if args.model is None:
        parser.error("--model DIR is required")
    return args


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    # Later signals are ignored, so stopping the children cannot itself be interrupted.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise StopRequested(signal.Signals(signum).name)


def watch(children: dict[str, EngineProcess]) -> str:
    """Block until a child exits; returns what happened to it."""
    while True:
        for name, child in children.items():
            code = child.exit_code()
            if code is not None:
                return f"{name} (pid {child.pid}) exited with code {code}"
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
    children: dict[str, EngineProcess] = {"engine_core": engine}
    try:
        engine.start()
        served = engine.wait_ready(args.ready_timeout_s)
        logger.info("engine core serves %s with %d KV blocks", args.model, served.cache.num_blocks)
        # Frontends start here (after READY, so they never talk to an engine still loading).
        print(f"ready: engine_core pid={engine.pid} address={engine.address}", flush=True)
        logger.error("%s; stopping everything", watch(children))
        return 1
    except StopRequested as signal_name:
        logger.info("%s: stopping everything", signal_name)
        return 0
    except EngineStartError as exc:
        logger.error("%s", exc)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for child in children.values():
            child.stop(args.stop_timeout_s)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    # Installed before anything starts, so no signal can leave a half-started child behind.
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    try:
        args = parse_args(argv)
        return serve(args)
    except StopRequested:
        return 0


if __name__ == "__main__":
    sys.exit(main())
