"""The engine's stats line: when it appears and what it says."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from conveyor.engine_core.stats_logger import StatsLogger, format_stats_line
from conveyor.protocol import SchedulerStats
from tests.engine_core.test_scheduler import make_request, run_to_end
from tests.fake_executor import make_scheduler


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_logger(interval_s: float = 10.0):
    scheduler = SimpleNamespace(stats=SchedulerStats(), num_preempted_waiting=0)
    scheduler.make_stats = lambda: scheduler.stats
    clock = Clock()
    return StatsLogger(scheduler, interval_s, engine_index=0, clock=clock), scheduler, clock


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "conveyor.engine_core.stats_logger"]


def test_a_line_every_interval_while_working_and_none_when_idle(caplog):
    caplog.set_level(logging.INFO)
    stats_logger, scheduler, clock = make_logger()
    clock.now += 10.0
    stats_logger.maybe_log()
    assert lines(caplog) == [], "no work yet: nothing to say"
    scheduler.stats = SchedulerStats(num_running=3, num_steps=40, num_prompt_tokens=500,
                                     num_generation_tokens=120)  # fmt: skip
    clock.now += 5.0
    stats_logger.maybe_log()
    assert lines(caplog) == [], "the interval is not up"
    clock.now += 5.0
    stats_logger.maybe_log()
    assert len(lines(caplog)) == 1
    # The engine finished its work during the next interval: that interval is still reported.
    scheduler.stats = SchedulerStats(num_steps=50, num_prompt_tokens=500, num_generation_tokens=150)
    clock.now += 10.0
    stats_logger.maybe_log()
    assert len(lines(caplog)) == 2 and "generation 3.0 tok/s, running 0" in lines(caplog)[-1]
    for _ in range(3):
        clock.now += 10.0
        stats_logger.maybe_log()
    assert len(lines(caplog)) == 2, "idle: silent"


def test_an_interval_of_zero_never_logs(caplog):
    caplog.set_level(logging.INFO)
    stats_logger, scheduler, clock = make_logger(interval_s=0.0)
    scheduler.stats = SchedulerStats(num_running=1, num_steps=5)
    clock.now += 100.0
    stats_logger.maybe_log()
    assert lines(caplog) == []


def test_the_line_gives_rates_queue_preemptions_cache_and_hits():
    before = SchedulerStats(num_prompt_tokens=1000, num_generation_tokens=200,
                            num_preemptions=1, prefix_cache_queries=100, prefix_cache_hits=10)  # fmt: skip
    after = SchedulerStats(num_running=12, num_waiting=3, kv_cache_usage=0.375,
                           num_prompt_tokens=3000, num_generation_tokens=700, num_preemptions=4,
                           prefix_cache_queries=300, prefix_cache_hits=160)  # fmt: skip
    line = format_stats_line(2, before, after, 10.0, num_preempted_waiting=1)
    assert line == (
        "engine 2: prompt 200.0 tok/s, generation 50.0 tok/s, running 12, "
        "waiting 3 (1 preempted), preemptions 3, KV cache 37.5 %, prefix cache hits 75.0 %"
    )


def test_under_a_tbt_slo_the_line_gives_the_models_error_and_steps_over_it():
    before = SchedulerStats(num_steps_timed=10, step_time_abs_error_s=0.1, step_time_s=2.0,
                            num_steps_over_tbt_slo=1)  # fmt: skip
    after = SchedulerStats(num_steps_timed=30, step_time_abs_error_s=0.22, step_time_s=5.0,
                           num_steps_over_tbt_slo=3)  # fmt: skip
    line = format_stats_line(0, before, after, 10.0, num_preempted_waiting=0)
    assert line.endswith(", step time error 4.0 %, steps over TBT SLO 2")
    assert "step time" not in format_stats_line(0, after, after, 10.0, num_preempted_waiting=0)


def test_a_real_scheduler_feeds_the_line(caplog):
    caplog.set_level(logging.INFO)
    scheduler, executor = make_scheduler()
    clock = Clock()
    stats_logger = StatsLogger(scheduler, 1.0, clock=clock)
    scheduler.add_request(make_request(0, prompt_len=6, max_tokens=5))
    run_to_end(scheduler, executor)
    clock.now += 2.0
    stats_logger.maybe_log()
    (line,) = lines(caplog)
    assert line.startswith("engine 0: prompt 3.0 tok/s, generation 2.0 tok/s, running 0, waiting 0")
