"""The base of both ZMQ engine clients: start or attach, then turn the engine's frames into
outputs, reports and a death notice, the same way for both.

Runs in the frontend process. The blocking ``MPEngineClient`` (``sync_client``) and the asyncio
``AsyncEngineClient`` (``async_client``) differ only in how they wait and deliver; the handshake,
the liveness check and the meaning of every frame are written once, here and in ``session``.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

from frontend.engine_client.engine_process import EngineProcess
from frontend.engine_client.session import (
    EngineDeadError,
    EngineLiveness,
    decode_ready_config,
)
from protocol import EngineConfig, EngineCoreOutputs, SchedulerStats
from protocol.codec import ENGINE_TO_CLIENT
from protocol.messages import AllFreeReport, EngineDead, EngineOutputsFrame, Ready

logger = logging.getLogger(__name__)


def launch_engine(
    config: EngineConfig | None,
    address: str | None,
    executor_backend: str | None,
    heartbeat_timeout_s: float | None,
) -> tuple[EngineProcess | None, str, EngineLiveness]:
    """Start an engine from ``config`` (the caller owns it), or prepare to attach at ``address``.

    Call from a long-lived thread: the engine's parent-death signal follows the thread that
    forked it. Returns the engine (or None), the address, and how to tell it died before Ready.
    """
    if (config is None) == (address is None):
        raise ValueError("give either a config (start an engine) or an address (attach)")
    if config is None:
        assert address is not None
        return None, address, EngineLiveness(address)
    engine = EngineProcess(config, executor_backend, heartbeat_timeout_s).start()
    return engine, engine.address, engine.liveness()


class EngineClientBase(ABC):
    """The state and frame handling both ZMQ clients share, after a successful handshake.

    Subclasses say what an output batch, a report and the engine's death mean to their callers
    (``_on_outputs``, ``_on_report``, ``_on_dead``); everything else is here once.
    """

    def __init__(
        self, address: str, ready: Ready, engine: EngineProcess | None, client_name: str
    ) -> None:
        self.address = address
        self.client_name = client_name
        self.client_index = ready.client_index
        self.engine_pid = ready.engine_pid
        self.config: EngineConfig = decode_ready_config(ready)
        self._engine = engine
        # Our own engine is watched exactly (its exit code); an attached one by its pid.
        self._liveness = engine.liveness() if engine else EngineLiveness(address, ready.engine_pid)
        self.dead_reason: str | None = None
        self.session_lost = False
        # Set once our own shutdown began: what follows is no news to an operator.
        self.closing = False
        # The engine's latest scheduler stats, from the last outputs this client received.
        self.stats: SchedulerStats | None = None

    @abstractmethod
    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        """An output batch for this client (called on the thread or loop that reads frames)."""

    @abstractmethod
    def _on_report(self, report: AllFreeReport) -> None:
        """The engine's answer to a CheckAllFree query."""

    @abstractmethod
    def _on_dead(self, error: EngineDeadError) -> None:
        """The engine is gone (or dropped us): fail whatever waits on it."""

    def _handle_frame(self, frame: bytes) -> bool:
        """Act on one frame from the engine; False once the engine said it is dead."""
        try:
            message = ENGINE_TO_CLIENT.decode(frame)
        except Exception as exc:
            logger.warning("dropped an undecodable frame from the engine: %s", exc)
            return True
        if isinstance(message, EngineOutputsFrame):
            if message.outputs.scheduler_stats is not None:
                self.stats = message.outputs.scheduler_stats
            self._on_outputs(message.outputs)
        elif isinstance(message, AllFreeReport):
            self._on_report(message)
        elif isinstance(message, EngineDead):
            self._mark_dead(message.reason, session_lost=message.client_dropped)
            return False
        return True

    def _check_liveness(self) -> bool:
        """False (and the client marked dead) once the engine process is gone."""
        reason = self._liveness.death_reason()
        if reason is not None:
            self._mark_dead(reason)
            return False
        return True

    def _mark_dead(self, reason: str, *, session_lost: bool = False) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        self.session_lost = session_lost
        if self.closing:
            logger.info("engine session closed: %s", reason)
        elif session_lost:
            logger.error("engine session lost: %s", reason)
        else:
            logger.error("engine dead: %s", reason)
        self._on_dead(EngineDeadError(reason))
