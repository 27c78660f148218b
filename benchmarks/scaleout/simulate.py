"""A discrete-event simulation of N engines behind the frontend's router.

Runs in the benchmark's own process. Events are session turns arriving and engine steps ending,
in virtual time. A turn goes through the real ``Router`` (the frontend's, with the same policies
and the same view of load: each engine's ``SchedulerStats`` after every step it runs, plus what
was routed since) to one ``SimEngine``; an engine that has work starts its next step when the
previous one ends. A turn's reply ending schedules the session's next turn after a think time.

What comes out: output tokens per second over the measured window (after a warm-up quarter),
TTFT and TPOT percentiles of the turns that arrived in it, and the prefix cache's hit rate (hit
tokens / prompt tokens looked up, all engines together).
"""

from __future__ import annotations

import heapq
import itertools
import statistics
from dataclasses import dataclass, field

from benchmarks.scaleout.sim_engine import SimEngine
from benchmarks.scaleout.step_cost_fit import StepCost
from benchmarks.scaleout.workload import Session, Workload, WorkloadConfig
from conveyor.engine_core import Request
from conveyor.frontend.engine_client.router import DEFAULT_AFFINITY_MARGIN, Router, RouterConfig
from conveyor.protocol import CacheConfig, SamplingParams, SchedulerConfig

_ARRIVAL, _STEP_DONE = 0, 1


@dataclass(frozen=True)
class SimConfig:
    num_engines: int
    policy: str
    # Sessions started per second, and for how long (the run ends when the last turn does).
    rate: float
    duration_s: float
    affinity_margin: float = DEFAULT_AFFINITY_MARGIN
    block_size: int = 16
    num_blocks: int = 4096
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 8192
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)


@dataclass
class _Turn:
    session: Session
    arrival_s: float
    engine: int
    first_token_s: float | None = None
    last_token_s: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)


@dataclass
class SimResult:
    num_engines: int
    policy: str
    rate: float
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    prefix_hit_rate: float
    num_turns: int
    # Turns of the window still waiting for their first token when the simulation stopped
    # (an overloaded run's queue): left out of the TTFT percentiles.
    num_without_first_token: int
    busy_share: float  # mean share of the window the engines were stepping


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


class Simulation:
    def __init__(self, config: SimConfig, cost: StepCost) -> None:
        self.config = config
        self.workload = Workload(config.workload)
        scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
        )
        cache_config = CacheConfig(
            block_size=config.block_size, enable_prefix_caching=True, num_blocks=config.num_blocks
        )
        self.engines = [
            SimEngine(scheduler_config, cache_config, cost, config.workload.vocab_size, seed=i)
            for i in range(config.num_engines)
        ]
        self.router = Router(
            config.num_engines,
            RouterConfig(config.policy, config.affinity_margin, config.block_size),
        )
        self._events: list[tuple[float, int, int, object]] = []
        self._order = itertools.count()
        self._turns: dict[int, _Turn] = {}
        self._next_req_id = 0
        self.done: list[_Turn] = []
        # The measured window (after a warm-up quarter) and what happened in it.
        self._window = (config.duration_s / 4, config.duration_s)
        self._window_tokens = 0
        self._window_busy_s = 0.0

    def _push(self, time_s: float, kind: int, payload: object) -> None:
        heapq.heappush(self._events, (time_s, next(self._order), kind, payload))

    def run(self) -> SimResult:
        config = self.config
        for session in self.workload.sessions(config.rate, config.duration_s):
            self._push(session.start_s, _ARRIVAL, session)
        warmup_s, end_s = self._window
        stats_at_warmup = None
        # Past the window only to see the first tokens of its last turns (an overloaded run's
        # queue would otherwise take long to drain, and says nothing more).
        while self._events and self._events[0][0] < end_s * 1.5:
            now, _, kind, payload = heapq.heappop(self._events)
            if stats_at_warmup is None and now >= warmup_s:
                stats_at_warmup = self._cache_counts()
            if kind == _ARRIVAL:
                self._arrive(now, payload)  # type: ignore[arg-type]
            else:
                self._step_done(now, payload)  # type: ignore[arg-type]
        return self._result(warmup_s, stats_at_warmup or (0, 0))

    def _arrive(self, now: float, session: Session) -> None:
        prompt = session.next_prompt()
        engine_index = self.router.choose(prompt)
        req_id = self._next_req_id
        self._next_req_id += 1
        params = SamplingParams(
            max_tokens=session.max_tokens[session.turn], temperature=0.0, ignore_eos=True
        )
        request = Request(
            req_id, prompt, params, max_model_len=self.config.max_model_len, arrival_time=now
        )
        self._turns[req_id] = _Turn(session, now, engine_index)
        engine = self.engines[engine_index]
        engine.add_request(request)
        if not engine.busy:
            self._start_step(now, engine_index)

    def _start_step(self, now: float, engine_index: int) -> None:
        engine = self.engines[engine_index]
        scheduler_output, duration = engine.schedule()
        engine.busy = scheduler_output.total_num_scheduled_tokens > 0
        if self._window[0] <= now < self._window[1]:
            self._window_busy_s += min(duration, self._window[1] - now)
        if engine.busy:
            self._push(now + duration, _STEP_DONE, (engine_index, scheduler_output))

    def _step_done(self, now: float, payload: tuple) -> None:
        engine_index, scheduler_output = payload
        engine = self.engines[engine_index]
        outputs = engine.finish(scheduler_output)
        in_window = self._window[0] <= now < self._window[1]
        for engine_outputs in outputs.values():
            for output in engine_outputs.outputs:
                turn = self._turns[int(output.request_id)]
                if output.new_token_ids and turn.first_token_s is None:
                    turn.first_token_s = now
                turn.last_token_s = now
                turn.output_token_ids += output.new_token_ids
                if in_window:
                    self._window_tokens += len(output.new_token_ids)
                if output.finish_reason is not None:
                    self._turn_ended(now, int(output.request_id))
        self.router.observe_stats(engine_index, engine.stats())
        engine.busy = False
        if engine.has_work():
            self._start_step(now, engine_index)

    def _turn_ended(self, now: float, req_id: int) -> None:
        turn = self._turns.pop(req_id)
        self.done.append(turn)
        if turn.session.replied(turn.output_token_ids):
            self._push(now + self.workload.think_time(), _ARRIVAL, turn.session)

    def _cache_counts(self) -> tuple[int, int]:
        stats = [engine.stats() for engine in self.engines]
        return sum(s.prefix_cache_queries for s in stats), sum(s.prefix_cache_hits for s in stats)

    def _result(self, warmup_s: float, at_warmup: tuple[int, int]) -> SimResult:
        config = self.config
        end_s = config.duration_s
        turns = self.done + list(self._turns.values())
        measured = [t for t in turns if warmup_s <= t.arrival_s < end_s]
        ttfts = [(t.first_token_s - t.arrival_s) * 1e3 for t in measured if t.first_token_s]
        tpots = [
            (t.last_token_s - t.first_token_s) * 1e3 / (len(t.output_token_ids) - 1)
            for t in measured
            if t.first_token_s is not None and len(t.output_token_ids) > 1
        ]
        queries, hits = self._cache_counts()
        queries -= at_warmup[0]
        hits -= at_warmup[1]
        busy = self._window_busy_s / (len(self.engines) * (end_s - warmup_s))
        return SimResult(
            num_engines=config.num_engines,
            policy=config.policy,
            rate=config.rate,
            output_tok_s=self._window_tokens / (end_s - warmup_s),
            ttft_p50_ms=_percentile(ttfts, 50),
            ttft_p99_ms=_percentile(ttfts, 99),
            tpot_p50_ms=_percentile(tpots, 50),
            tpot_p99_ms=_percentile(tpots, 99),
            prefix_hit_rate=hits / queries if queries else 0.0,
            num_turns=len(measured),
            num_without_first_token=sum(t.first_token_s is None for t in measured),
            busy_share=busy,
        )
