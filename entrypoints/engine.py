"""The engine-core process: ``python -m conveyor.entrypoints.engine --config-file F --address A``.

Runs in the engine-core process. Started by ``frontend.engine_client.EngineProcess`` (for ``LLM``
and the supervisor); runnable by hand to serve clients that attach by address:

    python -m conveyor.entrypoints.engine --config-file engine.msgpack --address ipc:///run/user/1000/e.sock

The config file holds one msgpack-encoded ``protocol.EngineConfig``. The address is ipc:// or
tcp:// (bind tcp to 127.0.0.1 unless the engine must be reachable from elsewhere, which takes
--allow-remote-clients and CURVE keys in $CONVEYOR_CURVE_KEYS). The executor the engine drives is built by ``conveyor.executor.backends``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec

from conveyor.engine_core.core_process import DEFAULT_HEARTBEAT_TIMEOUT_S, main
from conveyor.executor.backends import EXECUTOR_BACKENDS, make_executor
from conveyor.protocol import EngineConfig
from conveyor.runtime.dirs import remove_runtime_dir
from conveyor.runtime.flags import positive_float
from conveyor.runtime.logs import configure_logging
from conveyor.runtime.processes import pid_is_alive


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m conveyor.entrypoints.engine", description=__doc__
    )
    parser.add_argument("--config-file", type=Path, required=True, help="msgpack EngineConfig")
    parser.add_argument("--address", required=True, help="ipc://PATH or tcp://127.0.0.1:PORT")
    parser.add_argument(
        "--executor-backend",
        choices=EXECUTOR_BACKENDS,
        default=None,
        help="worker processes (mp, the default), one in-process worker, or Ray actors (ray)",
    )
    parser.add_argument(
        "--heartbeat-timeout-s",
        type=positive_float,
        default=DEFAULT_HEARTBEAT_TIMEOUT_S,
        help="a client silent this long is dropped and its requests aborted",
    )
    parser.add_argument(
        "--parent-pid", type=int, default=None, help="exit when this process (our parent) dies"
    )
    parser.add_argument(
        "--allow-remote-clients",
        action="store_true",
        help="allow a tcp address other hosts can reach (needs CURVE keys: $CONVEYOR_CURVE_KEYS)",
    )
    parser.add_argument(
        "--runtime-dir",
        type=Path,
        default=None,
        help="the folder we were started in (config, socket): removed when we exit, even when "
        "the process that made it is gone",
    )
    parser.add_argument(
        "--restartable",
        action="store_true",
        help="our parent restarts us in place (data parallelism): keep the runtime folder when "
        "we exit while the parent lives (it holds what the restarted engine and the frontends "
        "need); the parent removes it",
    )
    parser.add_argument("--log-level", default=None, help="default: $CONVEYOR_LOG_LEVEL or INFO")
    return parser.parse_args(argv)


def run(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging("engine_core", args.log_level)
    config = msgspec.msgpack.decode(args.config_file.read_bytes(), type=EngineConfig)
    try:
        return main(
            config,
            args.address,
            lambda config: make_executor(config, args.executor_backend),
            args.heartbeat_timeout_s,
            args.parent_pid,
            args.allow_remote_clients,
        )
    finally:
        parent_alive = args.parent_pid is not None and pid_is_alive(args.parent_pid)
        if args.runtime_dir is not None and not (args.restartable and parent_alive):
            # Whoever made it may be gone (a SIGKILLed supervisor): the engine outlives it.
            remove_runtime_dir(args.runtime_dir)


if __name__ == "__main__":
    sys.exit(run())
