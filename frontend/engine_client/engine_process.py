"""Start an engine-core process (``python -m conveyor.entrypoints.engine``), wait until it serves, stop it.

Runs in the process that owns the engine: an ``LLM`` caller, an engine client given a config, or
the supervisor. The engine gets a private runtime folder (0700) holding its config file and its
ipc:// socket (the engine removes it when it exits, so it goes even if we are killed), is told
our pid so it dies with us, and runs in its own session so a Ctrl-C in the terminal reaches only
us: we decide how the engine stops.
"""

from __future__ import annotations

import logging
import os

import msgspec
import zmq

from conveyor.frontend.engine_client.session import EngineLiveness, decode_ready_config, handshake
from conveyor.protocol import EngineConfig
from conveyor.protocol.codec import CLIENT_TO_ENGINE
from conveyor.protocol.messages import Goodbye
from conveyor.runtime.dirs import make_runtime_dir, remove_runtime_dir, restore_runtime_dir
from conveyor.runtime.processes import ENGINE_MODULE, ChildProcess
from conveyor.runtime.zmq_security import connect, keys_from_env

logger = logging.getLogger(__name__)

DEFAULT_STOP_TIMEOUT_S = 10.0


class EngineProcess(ChildProcess):
    """One engine-core child. ``start`` it, ``wait_ready``, and always ``stop`` it."""

    def __init__(
        self,
        config: EngineConfig,
        executor_backend: str | None = None,
        heartbeat_timeout_s: float | None = None,
        address: str | None = None,
        log_level: str | None = None,
        allow_remote_clients: bool = False,
        name: str = "engine_core",
        restartable: bool = False,
    ) -> None:
        """``restartable``: our owner starts it again in place when it dies (data parallelism),
        so its folder (config, socket) outlives each run while we live."""
        self.config = config
        self.runtime_dir = make_runtime_dir()
        self.address = address or f"ipc://{self.runtime_dir / 'engine.sock'}"
        self._config_file = self.runtime_dir / "engine-config.msgpack"
        self._config_file.write_bytes(msgspec.msgpack.encode(config))
        args = ["--config-file", str(self._config_file), "--address", self.address]
        args += ["--runtime-dir", str(self.runtime_dir)]
        args += ["--parent-pid", str(os.getpid())]
        if executor_backend is not None:
            args += ["--executor-backend", executor_backend]
        if heartbeat_timeout_s is not None:
            args += ["--heartbeat-timeout-s", str(heartbeat_timeout_s)]
        if log_level is not None:
            args += ["--log-level", log_level]
        if allow_remote_clients:
            args.append("--allow-remote-clients")
        if restartable:
            args.append("--restartable")
        super().__init__(name, ENGINE_MODULE, args)

    def start(self) -> EngineProcess:
        """Spawn the child (again, after it died). Call from a long-lived thread: the child's
        parent-death signal fires when the thread that forked it ends."""
        self.restore_folder()
        super().start()
        logger.info("engine core at %s", self.address)
        return self

    def restore_folder(self) -> None:
        """Make the runtime folder and config file again if a run removed them."""
        if not self._config_file.exists():
            # A run that ended with an error removed its folder: the next run needs it again.
            restore_runtime_dir(self.runtime_dir)
            self._config_file.write_bytes(msgspec.msgpack.encode(self.config))

    def liveness(self) -> EngineLiveness:
        return EngineLiveness(self.address, exit_code=self.exit_code)

    def wait_ready(self, timeout_s: float, stop_on_failure: bool = True) -> EngineConfig:
        """Block until the engine answers a Hello (stopping it if it never does, unless told
        not to); its config.

        A throwaway session (Hello, Ready, Goodbye) proves the engine serves clients, the same
        path every real client takes.
        """
        context = zmq.Context()
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 1000)
        try:
            # Our engine presents this host's own key (on a headless host not the head's).
            keys = keys_from_env()
            connect(socket, self.address, keys, keys.public_key if keys else None)
            ready = handshake(socket, self.liveness(), timeout_s, client_name="ready-probe")
            socket.send(CLIENT_TO_ENGINE.encode(Goodbye()))
        except BaseException:
            if stop_on_failure:
                self.stop()
            raise
        finally:
            socket.close()
            context.term()
        return decode_ready_config(ready)

    def stop(self, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``; removes the runtime folder. Idempotent."""
        code = super().stop(timeout_s)
        remove_runtime_dir(self.runtime_dir)
        return code
