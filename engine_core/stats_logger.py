"""The engine's stats line: what a person reads in the log while the engine works.

Runs in the engine-core process, called from the busy loop after every step and on every idle
wake-up (a comparison until the interval is up). Every ``interval_s`` it logs, at INFO, the
prompt and generation throughput over the interval, the running and waiting requests (and how
many of the waiting ones were preempted), the preemptions of the interval, KV cache usage and
the prefix-cache hit rate of the interval:

    engine 0: prompt 1834.2 tok/s, generation 512.0 tok/s, running 12, waiting 3 (1 preempted),
    preemptions 2, KV cache 37.5 %, prefix cache hits 61.2 %

With speculative decoding it goes on with the interval's draft acceptance rate and the mean
accepted length (tokens per request step that carried drafts, the bonus token included):
``, draft acceptance 71.3 %, mean accepted length 3.85``.

Under a TBT SLO the line goes on with the step-cost model's mean relative error over the
interval and the steps with decodes that took longer than the SLO:
``, step time error 4.1 %, steps over TBT SLO 0``.

It stays silent over an interval without work, so an idle engine writes nothing; the first
check after the work stops still reports that work's last interval. The numbers come from the
scheduler's cumulative counters, so a line costs nothing per step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from conveyor.engine_core.scheduler import Scheduler
from conveyor.protocol import SchedulerStats

logger = logging.getLogger(__name__)


class StatsLogger:
    def __init__(
        self,
        scheduler: Scheduler,
        interval_s: float,
        engine_index: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._scheduler = scheduler
        self.interval_s = interval_s
        self._engine_index = engine_index
        self._clock = clock
        self._last = scheduler.make_stats()
        self._last_time = clock()
        self._next_time = self._last_time + interval_s

    def maybe_log(self) -> None:
        """Log a line if the interval is up and the engine worked during it."""
        if self.interval_s <= 0:
            return
        now = self._clock()
        if now < self._next_time:
            return
        stats = self._scheduler.make_stats()
        worked = stats.num_steps > self._last.num_steps or stats.num_running or stats.num_waiting
        if worked:
            num_preempted = self._scheduler.num_preempted_waiting if stats.num_waiting else 0
            line = format_stats_line(
                self._engine_index, self._last, stats, now - self._last_time, num_preempted
            )
            logger.info("%s", line)
        self._last, self._last_time = stats, now
        self._next_time = now + self.interval_s


def format_stats_line(
    engine_index: int,
    before: SchedulerStats,
    after: SchedulerStats,
    elapsed_s: float,
    num_preempted_waiting: int,
) -> str:
    """One line from two cumulative snapshots ``elapsed_s`` apart."""
    elapsed_s = max(elapsed_s, 1e-9)
    prompt_rate = (after.num_prompt_tokens - before.num_prompt_tokens) / elapsed_s
    generation_rate = (after.num_generation_tokens - before.num_generation_tokens) / elapsed_s
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    hit_rate = 100.0 * hits / queries if queries else 0.0
    slo = ""
    if after.num_steps_timed > before.num_steps_timed:
        # Sum of |error| over the sum of step times: a mean relative error weighted by time.
        measured = after.step_time_s - before.step_time_s
        error = after.step_time_abs_error_s - before.step_time_abs_error_s
        over = after.num_steps_over_tbt_slo - before.num_steps_over_tbt_slo
        slo = (
            f", step time error {100.0 * error / measured if measured > 0 else 0.0:.1f} %, "
            f"steps over TBT SLO {over}"
        )
    drafts = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    if drafts:
        accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
        num_drafts = after.spec_num_drafts - before.spec_num_drafts
        slo += (
            f", draft acceptance {100.0 * accepted / drafts:.1f} %, "
            f"mean accepted length {1.0 + accepted / num_drafts:.2f}"
        )
    waiting = f"waiting {after.num_waiting}"
    if num_preempted_waiting:
        waiting += f" ({num_preempted_waiting} preempted)"
    return (
        f"engine {engine_index}: prompt {prompt_rate:.1f} tok/s, "
        f"generation {generation_rate:.1f} tok/s, running {after.num_running}, {waiting}, "
        f"preemptions {after.num_preemptions - before.num_preemptions}, "
        f"KV cache {100.0 * after.kv_cache_usage:.1f} %, prefix cache hits {hit_rate:.1f} %{slo}"
    )
