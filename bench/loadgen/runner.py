"""Sends a dataset's requests on an arrival schedule and collects what each one measured.

Runs in the load generator's process (conveyor bench serve), on its asyncio loop. Arrivals follow
a gamma process (shape = burstiness, mean gap = 1 / rate: burstiness 1 is Poisson, below 1
burstier, inf evenly spaced); rate inf sends everything at once. ``--max-concurrency`` holds a
request until a slot frees, and ``--duration`` stops sending after that many seconds (requests
already sent run to their end). A stop event (Ctrl-C) ends the run early: in-flight requests are
cancelled and counted as interrupted, and the rest of the report is still made.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import resource
import time
from dataclasses import dataclass

import aiohttp
import numpy as np
from tqdm import tqdm

from conveyor.bench.loadgen.client import Endpoint, RequestOutput, send_request
from conveyor.bench.loadgen.datasets import SampleRequest


@dataclass(frozen=True)
class TrafficSpec:
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    duration_s: float | None = None
    cancel_rate: float = 0.0
    seed: int = 0
    # The first this many requests are sent even after duration_s ran out: a capacity probe at
    # a low rate still sends enough requests for its percentiles to mean something.
    min_requests: int = 0


@dataclass
class RunResult:
    """The requests that were sent, and how long the run took."""

    outputs: list[RequestOutput]
    duration: float
    start_time: float  # time.perf_counter() when the first request was due
    arrival_offsets: np.ndarray  # the schedule, seconds after start_time
    num_interrupted: int = 0
    num_not_sent: int = 0  # due after --duration ran out
    client_cpu_seconds: float = 0.0  # this process's CPU time during the run


def arrival_offsets(
    num: int, rate: float, burstiness: float, rng: np.random.Generator
) -> np.ndarray:
    """When each request is due, in seconds from the start; the first is due at once."""
    if num == 0:
        return np.zeros(0)
    if math.isinf(rate):
        return np.zeros(num)
    if rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive")
    if math.isinf(burstiness):
        gaps = np.full(num - 1, 1.0 / rate)
    else:
        # Gamma with shape k and scale 1 / (rate * k) has mean 1 / rate at any k; its
        # coefficient of variation is 1 / sqrt(k), so a small k means bursts.
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num - 1)
    return np.concatenate(([0.0], np.cumsum(gaps)))


def cancel_points(
    samples: list[SampleRequest], cancel_rate: float, rng: np.random.Generator
) -> list[int | None]:
    """For each request, after how many content chunks the client drops it (None: never).

    The point is uniform over [0, output_len - 1]: 0 drops the stream right after the headers,
    and a request is never dropped at its very end, which would be a completion.
    """
    if not 0.0 <= cancel_rate <= 1.0:
        raise ValueError("--cancel-rate must be in [0, 1]")
    points: list[int | None] = []
    for sample in samples:
        drop = rng.random() < cancel_rate
        point = int(rng.integers(0, max(1, sample.output_len)))
        points.append(point if drop else None)
    return points


def open_session(max_concurrency: int | None, request_timeout_s: float) -> aiohttp.ClientSession:
    """One session for the whole run; its connection pool is as wide as the concurrency."""
    _raise_open_file_limit()
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=30)
    return aiohttp.ClientSession(connector=connector, timeout=timeout)


def _raise_open_file_limit() -> None:
    # Rate inf without --max-concurrency opens one socket per request.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def run_requests(
    session: aiohttp.ClientSession,
    endpoint: Endpoint,
    samples: list[SampleRequest],
    traffic: TrafficSpec,
    stop: asyncio.Event,
    progress: bool = True,
) -> RunResult:
    """Send ``samples`` on the traffic's schedule; returns when all are done or ``stop`` is set."""
    rng = np.random.default_rng(traffic.seed)
    offsets = arrival_offsets(len(samples), traffic.request_rate, traffic.burstiness, rng)
    cancels = cancel_points(samples, traffic.cancel_rate, rng)
    limit = asyncio.Semaphore(traffic.max_concurrency) if traffic.max_concurrency else None
    bar = tqdm(total=len(samples), disable=not progress, unit="req", dynamic_ncols=True)
    cpu_start = process_cpu_seconds()
    start = time.perf_counter()
    deadline = start + traffic.duration_s if traffic.duration_s else math.inf

    async def one(
        sample: SampleRequest, cancel_after: int | None, required: bool
    ) -> RequestOutput | None:
        due = time.perf_counter()
        async with limit or contextlib.nullcontext():
            if time.perf_counter() >= deadline and not required:
                return None
            out = await send_request(session, endpoint, sample, cancel_after)
        out.queue_time = out.start_time - due
        bar.update(1)
        return out

    tasks: list[asyncio.Task[RequestOutput | None]] = []
    for index, (sample, offset, cancel_after) in enumerate(zip(samples, offsets, cancels)):
        required = index < traffic.min_requests
        due = start + offset if required else min(start + offset, deadline)
        if not await _sleep_until(due, stop) or (start + offset >= deadline and not required):
            break
        tasks.append(asyncio.create_task(one(sample, cancel_after, required)))
    await _wait_all(tasks, stop)
    duration = time.perf_counter() - start
    bar.close()
    run = _collect(tasks, len(samples), duration, start, offsets)
    run.client_cpu_seconds = process_cpu_seconds() - cpu_start
    return run


def process_cpu_seconds() -> float:
    """User + system CPU seconds of this process (the client's own load)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _sleep_until(when: float, stop: asyncio.Event) -> bool:
    """Sleep until ``when`` (perf_counter); False when ``stop`` was set first."""
    delay = when - time.perf_counter()
    if delay > 0:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)
    return not stop.is_set()


async def _wait_all(tasks: list[asyncio.Task[RequestOutput | None]], stop: asyncio.Event) -> None:
    """Wait for every task, or for ``stop`` and then cancel the rest.

    A countdown, not asyncio.wait over the pending set: that re-registers a callback on every
    pending task per completion, quadratic in the number of requests.
    """
    all_done = asyncio.Event()
    remaining = len(tasks)

    def count(_: asyncio.Task[RequestOutput | None]) -> None:
        nonlocal remaining
        remaining -= 1
        if remaining == 0:
            all_done.set()

    for task in tasks:
        task.add_done_callback(count)
    if tasks:
        waiters = {asyncio.create_task(all_done.wait()), asyncio.create_task(stop.wait())}
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for waiter in waiters:
            waiter.cancel()
    for task in tasks:
        task.cancel()  # a no-op on finished tasks
    await asyncio.gather(*tasks, return_exceptions=True)


def _collect(
    tasks: list[asyncio.Task[RequestOutput | None]],
    num_samples: int,
    duration: float,
    start: float,
    offsets: np.ndarray,
) -> RunResult:
    outputs: list[RequestOutput] = []
    num_interrupted = num_not_sent = 0
    for task in tasks:
        if task.cancelled():
            num_interrupted += 1
        elif task.result() is None:
            num_not_sent += 1
        else:
            outputs.append(task.result())
    num_not_sent += num_samples - len(tasks)
    return RunResult(outputs, duration, start, offsets, num_interrupted, num_not_sent)
