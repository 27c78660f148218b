"""Step tracing: one JSON line per executed step, for plots of batch composition over time.

Runs in the engine-core process, on the busy loop's thread. A record says when the step ended,
how long the workers had it (from when it could start: its submission, or the end of the step
before it when steps overlap), what it held (prompt tokens vs generated tokens) and what the
engine looked like afterwards (running, waiting, KV usage, preemptions). ``conveyor plot-trace``
draws the picture the Orca and Sarathi-Serve papers draw from these.

Writes go through a buffered file: a line costs a few microseconds. The buffer is flushed
whenever the engine runs out of work, so a trace read while the engine idles holds every step so
far; it is complete once the engine stops (``close``), or up to the last flush if it is killed.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

import msgspec

from protocol import SchedulerStats


class StepTraceRecord(msgspec.Struct, omit_defaults=False):
    step_id: int
    # Seconds since the tracer started (monotonic clock), at the end of the step.
    time: float
    duration_ms: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_reqs: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    # Cumulative since the engine started.
    num_preemptions: int


class _Pending(msgspec.Struct):
    step_id: int
    submitted: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_reqs: int


class StepTracer:
    """Collects what each step held when it is scheduled; writes a line when it completes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("wb", buffering=1 << 16)
        self._encoder = msgspec.json.Encoder()
        self._start = time.monotonic()
        self._pending: deque[_Pending] = deque()
        self._last_end = self._start
        self.num_records = 0

    def step_submitted(self, step_id: int, stats: SchedulerStats, num_reqs: int) -> None:
        """Call right after scheduling a step that goes to the workers; ``stats`` of its plan."""
        self._pending.append(
            _Pending(
                step_id,
                time.monotonic(),
                stats.step_num_prefill_tokens,
                stats.step_num_decode_tokens,
                num_reqs,
            )
        )

    def step_done(self, stats: SchedulerStats) -> None:
        """Call when the oldest submitted step's output has been folded in."""
        pending = self._pending.popleft()
        now = time.monotonic()
        started = max(pending.submitted, self._last_end)
        self._last_end = now
        record = StepTraceRecord(
            step_id=pending.step_id,
            time=round(now - self._start, 6),
            duration_ms=round((now - started) * 1e3, 3),
            num_prefill_tokens=pending.num_prefill_tokens,
            num_decode_tokens=pending.num_decode_tokens,
            num_reqs=pending.num_reqs,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            kv_cache_usage=round(stats.kv_cache_usage, 5),
            num_preemptions=stats.num_preemptions,
        )
        self._file.write(self._encoder.encode(record) + b"\n")
        self.num_records += 1

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def read_trace(path: str | Path) -> list[StepTraceRecord]:
    """Every record of a trace file, in step order."""
    decoder = msgspec.json.Decoder(StepTraceRecord)
    with Path(path).open("rb") as f:
        return [decoder.decode(line) for line in f if line.strip()]
