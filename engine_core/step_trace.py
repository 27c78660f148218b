"""Step tracing: one JSON line per executed step, for plots of batch composition over time.

Runs in the engine-core process, on the busy loop's thread. A record says when the step ended,
how long the workers had it (from when it could start: its submission, or the end of the step
before it when steps overlap), what it held (prompt tokens vs generated tokens) and what the
engine looked like afterwards (running, waiting, KV usage, preemptions). ``conveyor plot-trace``
draws the picture the Orca and Sarathi-Serve papers draw from these. Under a TBT SLO a record
also says what the step-cost model predicted, the tokens the SLO allowed the step, and why a step
with decodes was predicted over the SLO, if it was (``engine_core/step_budget.py``); the engine's
start-up profile steps come first, marked ``profile``.

Writes go through a buffered file: a line costs a few microseconds. The buffer is flushed
whenever the engine runs out of work, so a trace read while the engine idles holds every step so
far; it is complete once the engine stops (``close``), or up to the last flush if it is killed.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

import msgspec

from conveyor.engine_core.step_budget import StepPrediction
from conveyor.protocol import SchedulerOutput, SchedulerStats


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
    # Under a TBT SLO (None without one): the step-cost model's prediction (None before it
    # had seen enough steps), the tokens the SLO allowed this step, why a step with decodes
    # was predicted over the SLO ("min-chunk", "decodes", "unfitted"), and whether the step
    # was one of the start-up profile's.
    predicted_ms: float | None = None
    token_budget: int | None = None
    over_slo: str | None = None
    profile: bool = False
    # (query, key) pairs the step's attention read, the step-cost model's context feature
    # (``attention_pairs``; 0 in traces written before it was recorded).
    num_attention_pairs: int = 0


class _Pending(msgspec.Struct):
    step_id: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_reqs: int
    num_attention_pairs: int


def attention_pairs(scheduler_output: SchedulerOutput) -> int:
    """The (query, key) pairs a step's causal attention reads: n query tokens from position c
    read n c + n (n + 1) / 2 keys in all (a decode at context c reads c + 1)."""
    cached = scheduler_output.scheduled_cached_reqs
    pairs = sum(
        n * c + n * (n + 1) // 2
        for c, n in zip(cached.num_computed_tokens, cached.num_scheduled_tokens)
    )
    for new in scheduler_output.scheduled_new_reqs:
        n, c = new.num_scheduled_tokens, new.num_computed_tokens
        pairs += n * c + n * (n + 1) // 2
    return pairs


class StepTracer:
    """Collects what each step held when it is scheduled; writes a line when it completes."""

    def __init__(self, path: str | Path, start: float | None = None) -> None:
        """``start``: the step clock's reading that is time 0 (default: monotonic now)."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("wb", buffering=1 << 16)
        self._encoder = msgspec.json.Encoder()
        self._start = time.monotonic() if start is None else start
        self._pending: deque[_Pending] = deque()
        self.num_records = 0

    def step_submitted(self, scheduler_output: SchedulerOutput, stats: SchedulerStats) -> None:
        """Call right after scheduling a step that goes to the workers; ``stats`` of its plan."""
        num_reqs = len(scheduler_output.scheduled_new_reqs) + len(
            scheduler_output.scheduled_cached_reqs.req_ids
        )
        self._pending.append(
            _Pending(
                scheduler_output.step_id,
                stats.step_num_prefill_tokens,
                stats.step_num_decode_tokens,
                num_reqs,
                attention_pairs(scheduler_output),
            )
        )

    def step_done(
        self,
        stats: SchedulerStats,
        end_time: float,
        duration_s: float,
        prediction: StepPrediction | None = None,
    ) -> None:
        """Call when the oldest submitted step's output has been folded in, at ``end_time``
        (monotonic clock), ``duration_s`` after the workers could start it."""
        pending = self._pending.popleft()
        record = StepTraceRecord(
            step_id=pending.step_id,
            time=round(end_time - self._start, 6),
            duration_ms=round(duration_s * 1e3, 3),
            num_prefill_tokens=pending.num_prefill_tokens,
            num_decode_tokens=pending.num_decode_tokens,
            num_reqs=pending.num_reqs,
            num_attention_pairs=pending.num_attention_pairs,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            kv_cache_usage=round(stats.kv_cache_usage, 5),
            num_preemptions=stats.num_preemptions,
        )
        if prediction is not None:
            if prediction.predicted_s is not None:
                record.predicted_ms = round(prediction.predicted_s * 1e3, 3)
            record.token_budget = prediction.token_budget
            record.over_slo = prediction.over_slo
            record.profile = prediction.profile
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
