"""How a frontend reaches an engine: the three clients, one import away.

Runs in the frontend process.
  ``MPEngineClient``        blocking, over ZMQ to an engine-core process (``LLM``'s default);
  ``AsyncEngineClient``     asyncio, over ZMQ, one output stream per request (HTTP servers);
  ``InProcessEngineClient`` the engine core and one worker in this process, stepped by the
                            caller (debugging: one process, one stack trace).
``MPEngineClient`` and ``InProcessEngineClient`` offer the same calls, so ``LLM`` does not care
which one it drives.
"""

from __future__ import annotations

from msgspec.structs import replace

from frontend.async_engine_client import AsyncEngineClient
from frontend.engine_session import EngineDeadError, EngineStartError
from frontend.mp_engine_client import MPEngineClient
from protocol import EngineConfig, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest

__all__ = [
    "AsyncEngineClient",
    "EngineDeadError",
    "EngineStartError",
    "InProcessEngineClient",
    "MPEngineClient",
]


class InProcessEngineClient:
    """``EngineCore`` + ``InProcessExecutor`` driven step by step from the caller's thread."""

    def __init__(self, config: EngineConfig) -> None:
        # Imported here: only this client needs the engine and a worker in-process.
        from engine_core import EngineCore
        from engine_core.executor import Executor
        from worker.executor import InProcessExecutor

        # The worker package may not import engine_core, so the executor is duck-typed there
        # and registered as an Executor here, where both are visible.
        Executor.register(InProcessExecutor)
        self._core = EngineCore(config, InProcessExecutor(config))
        # As a client of an engine process gets it in Ready: the engine's own (max_model_len
        # capped at the pool), with the num_blocks learned.
        core_config = self._core.config
        num_blocks = self._core.scheduler.kv_cache_manager.block_pool.num_blocks
        self.config = replace(core_config, cache=replace(core_config.cache, num_blocks=num_blocks))

    def add_request(self, request: EngineCoreRequest) -> list[EngineCoreOutput]:
        """Submit a request; returns its outputs at once only if the engine rejected it."""
        rejected = self._core.add_request(request)
        return [] if rejected is None else list(rejected.outputs)

    def add_requests(self, requests: list[EngineCoreRequest]) -> list[EngineCoreOutput]:
        """Submit several requests; the outputs of those the engine rejected at once."""
        return [output for request in requests for output in self.add_request(request)]

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._core.abort_requests(request_ids)

    def step(self) -> EngineCoreOutputs | None:
        """Run one engine step; the outputs for this client, or None when it produced none."""
        return self._core.step().get(0)

    def has_unfinished_requests(self) -> bool:
        return self._core.has_unfinished_requests()

    def check_all_free(self) -> None:
        """AssertionError unless no request is left and every KV block is free again."""
        self._core.check_all_free()

    def shutdown(self) -> None:
        self._core.shutdown()
