"""``python -m engine_core``: start an engine-core process serving clients at an address.

Runs in the engine-core process. Launched by ``frontend/engine_process.py`` (for ``LLM`` and
``scripts/serve.py``); runnable by hand to serve clients that attach by address:

    python -m engine_core --config-file engine.msgpack --address ipc:///run/user/1000/engine.sock

The config file holds one msgpack-encoded ``protocol.EngineConfig``. The address is ipc:// or
tcp:// (bind tcp to 127.0.0.1 unless the engine must be reachable from elsewhere: the socket
carries no authentication).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import msgspec

from engine_core.core_process import DEFAULT_HEARTBEAT_TIMEOUT_S, main
from engine_core.executor_factory import EXECUTOR_BACKENDS
from engine_core.lifecycle import configure_logging
from protocol import EngineConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engine_core", description=__doc__)
    parser.add_argument("--config-file", type=Path, required=True, help="msgpack EngineConfig")
    parser.add_argument("--address", required=True, help="ipc://PATH or tcp://127.0.0.1:PORT")
    parser.add_argument(
        "--executor-backend",
        choices=EXECUTOR_BACKENDS,
        default=None,
        help="worker processes (mp, the default when available) or one in-process worker",
    )
    parser.add_argument(
        "--heartbeat-timeout-s",
        type=float,
        default=DEFAULT_HEARTBEAT_TIMEOUT_S,
        help="a client silent this long is dropped and its requests aborted",
    )
    parser.add_argument(
        "--parent-pid", type=int, default=None, help="exit when this process (our parent) dies"
    )
    parser.add_argument(
        "--allow-remote-clients",
        action="store_true",
        help="allow a tcp address other hosts can reach (the socket has no authentication)",
    )
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def run(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging("engine_core", getattr(logging, args.log_level.upper(), logging.INFO))
    config = msgspec.msgpack.decode(args.config_file.read_bytes(), type=EngineConfig)
    return main(
        config,
        args.address,
        args.executor_backend,
        args.heartbeat_timeout_s,
        args.parent_pid,
        args.allow_remote_clients,
    )


if __name__ == "__main__":
    sys.exit(run())
