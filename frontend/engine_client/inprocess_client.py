"""``InProcessEngineClient``: the engine core and one worker in this process, stepped by the caller.

Runs in the frontend process: debugging, one process and one stack trace. It offers the same calls
as ``MPEngineClient``, so ``LLM`` does not care which one it drives. It is the one client that
builds an engine itself, so it is the one that imports the engine core and a worker.
"""

from __future__ import annotations

from conveyor.engine_core import EngineCore
from conveyor.executor.inprocess import InProcessExecutor
from conveyor.protocol import EngineConfig, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest


class InProcessEngineClient:
    """``EngineCore`` + ``InProcessExecutor`` driven step by step from the caller's thread."""

    def __init__(self, config: EngineConfig) -> None:
        # Imported here: only this client loads a model (and torch) in the caller's process.
        from conveyor.worker.worker import Worker

        self._core = EngineCore(config, InProcessExecutor(Worker(config, rank=0)))
        # As a client of an engine process gets it in Ready: the engine's own (max_model_len
        # capped at the pool), with the num_blocks and sliding window learned.
        self.config = self._core.config
        self.stats = None

    def add_requests(self, requests: list[EngineCoreRequest]) -> list[EngineCoreOutput]:
        """Submit several requests; the outputs of those the engine rejected at once."""
        rejected = [self._core.add_request(request) for request in requests]
        return [output for outputs in rejected if outputs is not None for output in outputs.outputs]

    def add_request(self, request: EngineCoreRequest) -> list[EngineCoreOutput]:
        return self.add_requests([request])

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._core.abort_requests(request_ids)

    def step(self) -> EngineCoreOutputs | None:
        """Run one engine step; the outputs for this client, or None when it produced none."""
        outputs = self._core.step().get(0)
        if outputs is not None and outputs.scheduler_stats is not None:
            self.stats = outputs.scheduler_stats
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self._core.has_unfinished_requests()

    def check_all_free(self) -> None:
        """AssertionError unless no request is left and every KV block is free again."""
        self._core.check_all_free()

    def shutdown(self) -> None:
        self._core.shutdown()
