"""The server's Prometheus metrics: vLLM's names and meanings with the ``conveyor:`` prefix, the
whole server's numbers whichever frontend process a scrape reaches.

Runs in an HTTP frontend process. Two kinds of numbers, both labelled ``model_name`` and
``engine`` (the engine's index among data-parallel engines; a request's numbers carry the label
of the engine that served it, ``metrics_requests``):

* What a frontend sees of its own requests (finished requests by reason, prompt and generation
  tokens, TTFT, inter-token and end-to-end latency, token-count and parameter histograms, HTTP
  statuses), recorded as they happen (generation tokens with every output of every engine step,
  written out at least once a second, never only when a choice ends) in prometheus_client's
  multiprocess mode: every frontend writes its own files in the folder all of a server's
  frontends share (``metrics_dir``), and a scrape of any of them sums every file.
* What only the engine core knows. Per request (how long it queued, prefilled and decoded), on
  its final output: recorded like the frontend's own. Engine-wide (running and waiting requests,
  KV cache usage, preemptions, prefix-cache lookups, tokens per step), as the ``SchedulerStats``
  that come with each engine's outputs, cumulative since that engine started. Every frontend
  holds its own latest copy of each engine's and publishes them at most once a second and right before it answers a
  scrape. The scrape takes, per series, the largest value any frontend published of a
  cumulative count: all frontends hold an earlier or later copy of the same count, so the largest
  is the newest, and the count never goes backwards from one scrape to the next whichever
  frontend answers. A gauge is the most recently published value. (A restarted engine counts
  from 0 again; the largest copy hides that until it has caught up.)

What belongs to a frontend, not an engine (HTTP statuses, requests in flight, the frontend_info
gauge) carries the first engine's label.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from conveyor.frontend.output_processor import ChoiceState
from conveyor.frontend.server.metrics_dir import MULTIPROC_DIR_ENV
from conveyor.frontend.server.metrics_export import Ratio, ServerCollector
from conveyor.frontend.server.metrics_requests import (
    LABELS,
    PREFIX,
    RequestMetrics,
    token_count_buckets,
)
from conveyor.protocol import ITERATION_TOKENS_BUCKETS, EngineConfig, RequestTimings, SchedulerStats

__all__ = ["PUBLISH_INTERVAL_S", "FrontendMetrics", "token_count_buckets"]

# How often a frontend publishes its copy of the engine's stats when nobody scrapes it.
PUBLISH_INTERVAL_S = 1.0

# The engine's cumulative counts, kept as gauges merged by their maximum, exported as counters.
_ENGINE_COUNTERS = {
    "num_preemptions": "Preemptions since the engine started (requests sent back to wait).",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
}
# Under a TBT SLO, the step-cost model's record, as counters too: metric name -> (field, doc).
_STEP_TIME_COUNTERS = {
    "step_time_predictions": (
        "num_steps_timed",
        "Steps whose time the step-cost model predicted and the engine measured (TBT SLO).",
    ),
    "step_time_prediction_abs_error_seconds": (
        "step_time_abs_error_s",
        "Sum of |measured - predicted| step time over those steps.",
    ),
    "step_time_seconds": ("step_time_s", "Sum of the measured time of those steps."),
    "steps_over_tbt_slo": (
        "num_steps_over_tbt_slo",
        "Steps with decodes that took longer than the TBT SLO.",
    ),
}
# Speculative decoding, vLLM's spec_decode counters: metric name -> (field, doc).
_SPEC_DECODE_COUNTERS = {
    "spec_decode_num_drafts": ("spec_num_drafts", "Requests' steps that carried draft tokens."),
    "spec_decode_num_draft_tokens": ("spec_num_draft_tokens", "Draft tokens scheduled."),
    "spec_decode_num_accepted_tokens": ("spec_num_accepted_tokens", "Draft tokens accepted."),
}
_SPEC_PER_POS = "spec_decode_num_accepted_tokens_per_pos"
_ITERATION_TOKENS = PREFIX + "iteration_tokens_total"


class FrontendMetrics:
    """Every metric this frontend records or publishes, and the merged scrape.

    Needs prometheus_client in multiprocess mode (``metrics_dir.ensure_multiprocess_dir`` before
    it was first imported): otherwise nothing this process records would reach a scrape.
    ``engines``: the engines' labels (or one engine's index).
    """

    def __init__(
        self, config: EngineConfig, model_name: str, engines: int | Sequence[str] = 0
    ) -> None:
        path = os.environ.get(MULTIPROC_DIR_ENV)
        if not path:
            raise RuntimeError(f"${MULTIPROC_DIR_ENV} must be set before prometheus_client loads")
        labels = [str(engines)] if isinstance(engines, int) else list(engines)
        self._model_name = model_name
        self._default_engine = labels[0]
        self._max_model_len = config.scheduler.max_model_len
        self._requests: dict[str, RequestMetrics] = {}
        self._engines = {label: _EngineGauges(config, model_name, label) for label in labels}
        self._define_frontend_metrics()
        self._registry = CollectorRegistry(auto_describe=False)
        counters = [
            PREFIX + name
            for name in (*_ENGINE_COUNTERS, *_STEP_TIME_COUNTERS, *_SPEC_DECODE_COUNTERS)
        ]
        counters.append(PREFIX + _SPEC_PER_POS)
        hit_rate = Ratio(
            PREFIX + "prefix_cache_hit_rate",
            "Prefix cache hits / queries since the engine started.",
            PREFIX + "prefix_cache_hits",
            PREFIX + "prefix_cache_queries",
        )
        step_time_error = Ratio(
            PREFIX + "step_time_prediction_error_ratio",
            "The step-cost model's relative error: sum of |measured - predicted| / sum of "
            "measured step times since the engine started (TBT SLO; 0 without one).",
            PREFIX + "step_time_prediction_abs_error_seconds",
            PREFIX + "step_time_seconds",
        )
        ratios = [hit_rate, step_time_error]
        self._registry.register(ServerCollector(path, counters, [_ITERATION_TOKENS], ratios))
        self._published: tuple[tuple[SchedulerStats | None, ...], int] = ((), -1)

    def _define_frontend_metrics(self) -> None:
        labels = (self._model_name, self._default_engine)
        self._in_flight = Gauge(
            PREFIX + "num_http_requests_in_flight", "Generation requests the frontends serve.",
            LABELS, registry=None, multiprocess_mode="livesum",
        ).labels(*labels)  # fmt: skip
        Gauge(
            PREFIX + "frontend_info", "One per live frontend process (labelled pid).", LABELS,
            registry=None, multiprocess_mode="liveall",
        ).labels(*labels).set(1)  # fmt: skip
        self._responses = Counter(
            PREFIX + "http_responses", "HTTP responses by status code.", ("model_name", "code"),
            registry=None,
        )  # fmt: skip
        self._responses_by_code: dict[int, Counter] = {}

    def _for_engine(self, engine: str | None) -> RequestMetrics:
        label = self._default_engine if engine is None else engine
        series = self._requests.get(label)
        if series is None:
            series = RequestMetrics(self._model_name, label, self._max_model_len)
            self._requests[label] = series
        return series

    # ------------------------------------------------------------------ what this frontend sees

    def observe_tokens(
        self,
        choice: ChoiceState,
        num_new_tokens: int,
        previous: float | None,
        engine: str | None = None,
    ) -> None:
        """An output of ``choice`` (served by ``engine``) brought tokens; ``previous`` was its
        last token's time."""
        self._for_engine(engine).observe_tokens(choice, num_new_tokens, previous)

    def observe_finished(
        self,
        choice: ChoiceState,
        reason: str,
        timings: RequestTimings | None,
        engine: str | None = None,
    ) -> None:
        """``choice`` ended (``reason``); ``timings`` came with its final engine output."""
        self._for_engine(engine).observe_finished(choice, reason, timings)

    def observe_request(self, choices: Sequence[ChoiceState], n: int) -> None:
        """An HTTP request's choices all ended: per prompt, its n and its longest choice."""
        self._for_engine(None).observe_request(choices, n)

    def observe_response(self, status: int) -> None:
        counter = self._responses_by_code.get(status)
        if counter is None:
            counter = self._responses.labels(self._model_name, str(status))
            self._responses_by_code[status] = counter
        counter.inc()

    # ------------------------------------------------------------------ the engines' numbers

    def publish(self, stats: SchedulerStats | None, num_in_flight: int) -> None:
        """``publish_engines`` with one engine's stats (the first engine's)."""
        self.publish_engines({self._default_engine: stats}, num_in_flight)

    def publish_engines(
        self, stats_by_engine: Mapping[str, SchedulerStats | None], num_in_flight: int
    ) -> None:
        """Write this frontend's copy of each engine's stats (and its requests in flight) where
        the other frontends' scrapes read them, if they changed since the last time; and the
        tokens counted since the last write."""
        for series in self._requests.values():
            series.save_counts()
        snapshot = tuple(stats_by_engine.values())
        published, published_in_flight = self._published
        unchanged = len(snapshot) == len(published) and all(
            a is b for a, b in zip(snapshot, published)
        )
        if unchanged and num_in_flight == published_in_flight:
            return
        self._published = (snapshot, num_in_flight)
        self._in_flight.set(num_in_flight)
        for label, stats in stats_by_engine.items():
            gauges = self._engines.get(label)
            if stats is not None and gauges is not None:
                gauges.publish(stats)

    def render(self) -> bytes:
        """The whole server's metrics in Prometheus's text format, from every frontend's files
        (call ``publish`` first, on the event loop, to bring this frontend's own up to date).
        Reads files only, so it may run on another thread."""
        return generate_latest(self._registry)


class _EngineGauges:
    """One engine's stats as this frontend publishes them (gauges merged across frontends)."""

    def __init__(self, config: EngineConfig, model_name: str, engine: str) -> None:
        labels = (model_name, engine)

        def gauge(name: str, doc: str, mode: str, extra: Sequence[str] = ()) -> Gauge:
            return Gauge(
                PREFIX + name, doc, (*LABELS, *extra), registry=None, multiprocess_mode=mode
            )

        def own(name: str, doc: str, mode: str) -> Gauge:
            return gauge(name, doc, mode).labels(*labels)

        recent = "livemostrecent"
        self._running = own("num_requests_running", "Requests in the engine's batch.", recent)
        self._waiting = own("num_requests_waiting", "Requests waiting in the engine.", recent)
        self._kv_usage = own("kv_cache_usage_perc", "Fraction of KV cache blocks in use.", recent)
        self._counts = {
            field: own(field, doc, "livemax") for field, doc in _ENGINE_COUNTERS.items()
        }
        for name, (field, doc) in (*_STEP_TIME_COUNTERS.items(), *_SPEC_DECODE_COUNTERS.items()):
            self._counts[field] = own(name, doc, "livemax")
        spec = config.scheduler.speculative
        doc = "Draft tokens accepted at each draft position (0 = the first after the last token)."
        per_pos = gauge(_SPEC_PER_POS, doc, "livemax", ("position",))
        num_positions = spec.num_speculative_tokens if spec is not None else 0
        self._accepted_per_pos = [per_pos.labels(*labels, str(i)) for i in range(num_positions)]
        doc = "Tokens per engine step."
        bucket = gauge("iteration_tokens_total_bucket", doc, "livemax", ("le",))
        bounds = [*(str(float(b)) for b in ITERATION_TOKENS_BUCKETS), "+Inf"]
        self._iteration_buckets = [bucket.labels(*labels, le) for le in bounds]
        self._iteration_sum = own("iteration_tokens_total_sum", doc, "livemax")
        self._iteration_count = own("iteration_tokens_total_count", doc, "livemax")
        cache = config.cache
        info = {
            "block_size": str(cache.block_size),
            "enable_prefix_caching": str(cache.enable_prefix_caching),
            "num_gpu_blocks": str(cache.num_blocks),
            # Both "None" when unset, as vLLM labels an unset kv_cache_memory_bytes: they then
            # follow from the device (CUDA: a 0.9 share and the rest of it; CPU: 1 GiB).
            "gpu_memory_utilization": str(cache.gpu_memory_utilization),
            "kv_cache_memory_bytes": str(cache.kv_cache_memory),
        }
        doc = "The KV cache's configuration."
        gauge("cache_config_info", doc, "livemax", tuple(info)).labels(*labels, *info.values()).set(
            1
        )
        # vLLM's: one series per (running, waiting) set of adapter names, its value the time it
        # was last true; the newest series is the current state.
        self._labels = labels
        self._lora_info = None
        self._max_lora = str(config.lora.max_loras) if config.lora is not None else ""
        if config.lora is not None:
            names = ("max_lora", "running_lora_adapters", "waiting_lora_adapters")
            doc = "Running and waiting LoRA adapters (the newest series is the current state)."
            self._lora_info = gauge("lora_requests_info", doc, "livemostrecent", names)

    def publish(self, stats: SchedulerStats) -> None:
        if self._lora_info is not None:
            running = ",".join(stats.running_lora_adapters)
            waiting = ",".join(stats.waiting_lora_adapters)
            series = self._lora_info.labels(*self._labels, self._max_lora, running, waiting)
            series.set(time.time())
        self._running.set(stats.num_running)
        self._waiting.set(stats.num_waiting)
        self._kv_usage.set(stats.kv_cache_usage)
        for field, gauge in self._counts.items():
            gauge.set(getattr(stats, field))
        cumulative = 0
        counts = stats.iteration_tokens
        for i, gauge in enumerate(self._iteration_buckets):
            cumulative += counts[i] if i < len(counts) else 0
            gauge.set(cumulative)
        for gauge, count in zip(self._accepted_per_pos, stats.spec_accepted_per_pos):
            gauge.set(count)
        self._iteration_sum.set(stats.num_prompt_tokens + stats.num_generation_tokens)
        self._iteration_count.set(stats.num_steps)
