"""Tensor parallelism end to end: two worker processes (gloo on CPU) behind EngineCore.

Each rank holds half the attention and KV heads, half the MLP and half the vocabulary; the row
layers all-reduce and the LM head gathers the logits on every rank, so every rank samples the same
tokens and keeps the same request mirror. The tests compare with one rank in-process, and check
that a fault on rank 1 is blamed on rank 1 even though rank 0 then fails inside a collective.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from conveyor.engine_core import EngineCore
from conveyor.executor.backends import make_executor
from conveyor.executor.multiproc import MultiprocExecutor, WorkerDiedError, WorkerFailedError
from conveyor.protocol import EngineConfig, EngineCoreRequest
from tests.multiproc_helpers import (
    GREEDY,
    generate,
    listening_tcp_addresses,
    make_config,
    make_requests,
    wait_until_gone,
)

pytestmark = pytest.mark.slow


def _reference(config: EngineConfig) -> tuple[dict[str, list[int]], int]:
    """Tokens and KV blocks with one rank in this process."""
    core = EngineCore(config, make_executor(config, "inprocess"))
    try:
        return generate(
            core, make_requests()
        ), core.scheduler.kv_cache_manager.block_pool.num_blocks
    finally:
        core.shutdown()


# qwen3: tied embeddings (the vocab-parallel table is also the LM head); qwen2: sharded q/k/v bias;
# qwen3_moe: every expert's intermediate features split, replicated routers, a dense layer too.
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "qwen3_moe"])
def test_two_ranks_give_the_tokens_of_one_rank(tiny_model_dirs, tiny_moe_model_dirs, arch):
    model_dir = {**tiny_model_dirs, **tiny_moe_model_dirs}[arch]
    expected, num_blocks_one_rank = _reference(make_config(model_dir))
    config = make_config(model_dir, tensor_parallel_size=2)
    executor = MultiprocExecutor(config, startup_timeout_s=60)
    try:
        core = EngineCore(config, executor)
        # Each rank stores one of the two KV heads: the same bytes hold twice the blocks.
        assert core.scheduler.kv_cache_manager.block_pool.num_blocks == 2 * num_blocks_one_rank
        assert generate(core, make_requests()) == expected
        # Internal sockets never face the network: gloo listens on loopback only.
        for pid in executor.worker_pids:
            addresses = listening_tcp_addresses(pid)
            assert addresses, "gloo should listen somewhere"
            assert all(a.startswith(("127.", "[::1]")) for a in addresses), addresses
    finally:
        executor.shutdown()
    wait_until_gone(executor.worker_pids, timeout_s=1.0)


def _two_rank_engine(tiny_model_dir) -> tuple[EngineCore, MultiprocExecutor]:
    config = make_config(tiny_model_dir, tensor_parallel_size=2)
    executor = MultiprocExecutor(config, startup_timeout_s=60)
    core = EngineCore(config, executor)
    core.add_request(EngineCoreRequest("a", list(range(1, 30)), GREEDY, 0.0))
    return core, executor


def test_killing_rank_1_is_blamed_on_rank_1(tiny_model_dir):
    core, executor = _two_rank_engine(tiny_model_dir)
    try:
        core.step()
        os.kill(executor.worker_pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="rank 1") as died:
            for _ in range(20):
                core.step()
        assert died.value.rank == 1
        assert time.monotonic() - start < 5.0
    finally:
        core.shutdown()
    wait_until_gone(executor.worker_pids, timeout_s=1.0)


def test_an_exception_on_rank_1_is_blamed_on_rank_1(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("CONVEYOR_FAULT_INJECT", "raise@step=2,rank=1")
    core, executor = _two_rank_engine(tiny_model_dir)
    try:
        core.step()
        start = time.monotonic()
        with pytest.raises(WorkerFailedError, match="InjectedFault") as failed:
            core.step()
        assert failed.value.rank == 1
        assert time.monotonic() - start < 5.0
    finally:
        core.shutdown()
    wait_until_gone(executor.worker_pids, timeout_s=1.0)
