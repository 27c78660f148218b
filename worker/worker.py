"""One worker rank: picks its device, sets up threads and collectives, wraps the model runner.

Runs in a worker process (or in the engine process, through ``InProcessExecutor``). The same
``Worker`` serves both: an executor decides where it lives, the worker does not know.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

from conveyor.protocol import EngineConfig, ModelRunnerOutput, SchedulerOutput
from conveyor.worker import native
from conveyor.worker.attention.torch_backend import TorchAttentionBackend
from conveyor.worker.layers.cpu_ops import load_token_ops
from conveyor.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def resolve_device(name: str, rank: int) -> torch.device:
    """ "auto" -> CUDA when available, else CPU; a bare "cuda" picks the rank's own GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", rank % max(torch.cuda.device_count(), 1))
    return device


def num_cpu_threads(tp_size: int) -> int:
    """The cores this process may run on, shared evenly among the ranks on this machine."""
    num_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (num_cores or 1) // tp_size)


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory_in_heap() -> bool:
    """Stop glibc from returning big activation buffers to the OS after every layer.

    A prefill step allocates and frees tens of MB per op; by default glibc serves those with
    mmap/munmap (or trims the heap), so every step page-faults them in again: up to ~100k minor
    faults and ~20% of a 2048-token step measured on the bench model. Keeping freed memory in the
    heap makes the next step reuse it. Returns False where the C library is not glibc.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(
            libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
        )
    except (OSError, AttributeError):
        return False


def build_cpu_kernels(runner: ModelRunner) -> None:
    """Build the compiled CPU paths (or load them from their cache) before the worker reports
    ready: built on first use, they made the first request after "ready" wait for the
    compiler (about a second each). Without a compiler, one warning says what that costs."""
    if native.warn_if_no_compiler(logger):
        return
    start = time.perf_counter()
    load_token_ops()
    if isinstance(runner.backend, TorchAttentionBackend):
        runner.backend.load_cpu_kernel(runner.dtype, runner.kv_dtype)
    logger.debug("compiled CPU paths ready in %.2f s", time.perf_counter() - start)


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        rank: int = 0,
        distributed_init_method: str | None = None,
    ) -> None:
        self.rank = rank
        self.tp_size = config.parallel.tensor_parallel_size
        self.device = resolve_device(config.device, rank)
        if self.device.type == "cpu":
            # Intra-op threads beyond the free cores only add contention between the ranks on
            # this host (the other hosts' ranks have their own cores); data-parallel engines on
            # this host share its cores too.
            parallel = config.parallel
            ranks_here = self.tp_size // parallel.nodes.nnodes * parallel.data_parallel_size
            torch.set_num_threads(num_cpu_threads(ranks_here))
            keep_freed_memory_in_heap()
        else:
            torch.cuda.set_device(self.device)
        if self.tp_size > 1:
            self._init_distributed(distributed_init_method)
        # Unseeded random sampling draws from the global generator: make runs repeatable.
        torch.manual_seed(config.model.seed)
        self.runner = ModelRunner(config, self.device, rank, self.tp_size)
        if self.device.type == "cpu":
            build_cpu_kernels(self.runner)

    def _init_distributed(self, init_method: str | None) -> None:
        if dist.is_initialized():
            return
        if init_method is None:
            raise ValueError("tensor_parallel_size > 1 needs a distributed_init_method")
        dist.init_process_group(
            backend="nccl" if self.device.type == "cuda" else "gloo",
            init_method=init_method,
            rank=self.rank,
            world_size=self.tp_size,
        )

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.runner.initialize_cache(num_blocks)

    def kv_sliding_window(self) -> int | None:
        return self.runner.kv_sliding_window()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.runner.release()
        if self.tp_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
