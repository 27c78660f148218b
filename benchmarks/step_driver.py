"""Drive a worker with hand-made scheduler outputs and time its steps, as the engine core would.

Runs in the benchmark's own process (``python -m benchmarks gpu-check``). No scheduler, no processes, no wire:
what is timed is the worker alone (inputs, forward, sampling, the sampled tokens back on the
host), the part CUDA graphs and the sync-free inputs are about. Block ids are handed out in order
and every request is finished before the next batch starts, so the pool never fragments.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from conveyor.protocol import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from conveyor.worker.worker import Worker

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)


class StepDriver:
    """Requests a worker runs, by hand: start (prefill within the token budget), decode, finish."""

    def __init__(self, worker: Worker, num_blocks: int, vocab_size: int) -> None:
        config = worker.runner.config
        self.worker = worker
        self.device = worker.device
        self.block_size = config.cache.block_size
        self.budget = config.scheduler.max_num_batched_tokens
        self.num_blocks = num_blocks
        self.vocab_size = vocab_size
        self._step = 0
        self._next_req = 0
        self._next_block = 1  # block 0 is the null block
        self._computed: dict[int, int] = {}
        self._rng = np.random.default_rng(0)

    def start(self, num_requests: int, prompt_len: int, room: int) -> list[int]:
        """Prefill ``num_requests`` random prompts, with blocks for ``room`` more tokens each."""
        req_ids = []
        pending: list[NewRequestData] = []
        for _ in range(num_requests):
            if pending and (len(pending) + 1) * prompt_len > self.budget:
                self._run(SchedulerOutput(self._next_step(), pending))
                pending = []
            req_id = self._next_req
            self._next_req += 1
            prompt = self._rng.integers(3, self.vocab_size, prompt_len).tolist()
            blocks = self._blocks(prompt_len + room)
            pending.append(NewRequestData(req_id, prompt, GREEDY, blocks, 0, prompt_len))
            self._computed[req_id] = prompt_len
            req_ids.append(req_id)
        self._run(SchedulerOutput(self._next_step(), pending))
        return req_ids

    def decode(self, req_ids: list[int]) -> None:
        """One decode step of every request in ``req_ids``."""
        computed = [self._computed[r] for r in req_ids]
        cached = CachedRequestData(
            req_ids=list(req_ids),
            new_block_ids=[[] for _ in req_ids],
            num_computed_tokens=computed,
            num_scheduled_tokens=[1] * len(req_ids),
            resumed_token_ids={},
        )
        self._run(SchedulerOutput(self._next_step(), scheduled_cached_reqs=cached))
        for r in req_ids:
            self._computed[r] += 1

    def finish(self, req_ids: list[int]) -> None:
        self._run(SchedulerOutput(self._next_step(), finished_req_ids=list(req_ids)))
        for r in req_ids:
            del self._computed[r]
        if not self._computed:
            self._next_block = 1

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, run, repeats: int = 1) -> float:
        """Median wall seconds of ``run()`` over ``repeats`` calls, each with the device drained
        around it (a decode step waits for its sampled tokens anyway; a prompt chunk does not).
        The median, because a shared machine's scheduler hiccups land on single calls."""
        times = []
        for _ in range(repeats):
            self.synchronize()
            start = time.perf_counter()
            run()
            self.synchronize()
            times.append(time.perf_counter() - start)
        return float(np.median(times))

    def _run(self, output: SchedulerOutput) -> None:
        self.worker.execute_model(output)

    def _next_step(self) -> int:
        self._step += 1
        return self._step

    def _blocks(self, num_tokens: int) -> list[int]:
        count = -(-num_tokens // self.block_size)
        if self._next_block + count > self.num_blocks:
            raise RuntimeError(f"the KV cache holds {self.num_blocks} blocks; the check needs more")
        first, self._next_block = self._next_block, self._next_block + count
        return list(range(first, first + count))


def count_launches(run, device: torch.device) -> int | None:
    """Kernel and graph launches the host makes during ``run()`` (CUDA; None elsewhere)."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    # cudaLaunchKernel / cuLaunchKernel(Ex) for kernels, cudaGraphLaunch for a graph replay.
    return sum(1 for e in prof.events() if "LaunchKernel" in e.name or "GraphLaunch" in e.name)
