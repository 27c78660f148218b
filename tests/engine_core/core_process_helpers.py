"""Shared by the engine-core process tests: a fake-model config, requests, and collecting outputs.

Runs in the test process. ``ClientPool`` attaches ``MPEngineClient``s and shuts every one of them
down at the end, whatever happened.
"""

from __future__ import annotations

import time

from conveyor.frontend.engine_client.sync_client import MPEngineClient
from conveyor.protocol import (
    CacheConfig,
    EngineConfig,
    EngineCoreRequest,
    ModelConfig,
    SamplingParams,
    SchedulerConfig,
)
from tests.fake_executor import fake_next_token

VOCAB = 50
MAX_MODEL_LEN = 512
BLOCK_SIZE = 4


def fake_config() -> EngineConfig:
    return EngineConfig(
        model=ModelConfig("fake", "Fake", vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN),
        cache=CacheConfig(block_size=BLOCK_SIZE),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_model_len=MAX_MODEL_LEN),
    )


def request(request_id: str, prompt: list[int], max_tokens: int = 6) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(request_id, prompt, params, time.time())


def expected_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    history = list(prompt)
    for _ in range(max_tokens):
        history.append(fake_next_token(history, VOCAB))
    return history[len(prompt) :]


def collect(client: MPEngineClient, timeout_s: float = 10.0) -> dict[str, tuple[list[int], str]]:
    """request_id -> (tokens, finish_reason) until the client has nothing unfinished."""
    results: dict[str, tuple[list[int], str]] = {}
    deadline = time.monotonic() + timeout_s
    while client.has_unfinished_requests():
        assert time.monotonic() < deadline, "outputs did not arrive in time"
        outputs = client.get_outputs(0.2)
        for out in outputs.outputs if outputs else []:
            tokens, _ = results.get(out.request_id, ([], ""))
            results[out.request_id] = (tokens + out.new_token_ids, out.finish_reason or "")
    return results


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class ClientPool:
    """Attaches clients; on exit shuts every one of them down, whatever happened."""

    def __init__(self) -> None:
        self._clients: list[MPEngineClient] = []

    def __call__(self, address: str, **kwargs: object) -> MPEngineClient:
        client = MPEngineClient(address=address, ready_timeout_s=5.0, **kwargs)  # type: ignore[arg-type]
        self._clients.append(client)
        return client

    def __enter__(self) -> ClientPool:
        return self

    def __exit__(self, *exc: object) -> None:
        for client in self._clients:
            client.shutdown()
