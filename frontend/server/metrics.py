"""The server's Prometheus metrics: vLLM's names and meanings with the ``conveyor:`` prefix, the
whole server's numbers whichever frontend process a scrape reaches.

Runs in an HTTP frontend process. Two kinds of numbers, both labelled ``model_name`` and
``engine`` (the engine's index, for data parallelism):

* What a frontend sees of its own requests (finished requests by reason, prompt and generation
  tokens, TTFT, inter-token and end-to-end latency, token-count and parameter histograms, HTTP
  statuses), recorded as they happen (generation tokens with every output of every engine step,
  written out at least once a second, never only when a choice ends) in prometheus_client's
  multiprocess mode: every frontend writes its own files in the folder all of a server's
  frontends share (``metrics_dir``), and a scrape of any of them sums every file.
* What only the engine core knows. Per request (how long it queued, prefilled and decoded), on
  its final output: recorded like the frontend's own. Engine-wide (running and waiting requests,
  KV cache usage, preemptions, prefix-cache lookups, tokens per step), as the ``SchedulerStats``
  that come with the engine's outputs, cumulative since the engine started. Every frontend holds
  its own latest copy and publishes it at most once a second and right before it answers a
  scrape. The scrape takes, per series, the largest value any frontend published of a
  cumulative count: all frontends hold an earlier or later copy of the same count, so the largest
  is the newest, and the count never goes backwards from one scrape to the next whichever
  frontend answers. A gauge is the most recently published value.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from frontend.output_processor import ChoiceState
from frontend.server.metrics_dir import MULTIPROC_DIR_ENV
from frontend.server.metrics_export import Ratio, ServerCollector
from protocol import ITERATION_TOKENS_BUCKETS, EngineConfig, RequestTimings, SchedulerStats

PREFIX = "conveyor:"
LABELS = ("model_name", "engine")

# Bucket bounds in seconds (vLLM's, with finer steps at the short end for small models).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                           20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
                           7680.0)  # fmt: skip
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error", "rejected")
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
_ITERATION_TOKENS = PREFIX + "iteration_tokens_total"


def token_count_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_model_len`` (vLLM's series for token counts)."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > max_model_len:
                return buckets
            buckets.append(step * scale)
        scale *= 10


class FrontendMetrics:
    """Every metric this frontend records or publishes, and the merged scrape.

    Needs prometheus_client in multiprocess mode (``metrics_dir.ensure_multiprocess_dir`` before
    it was first imported): otherwise nothing this process records would reach a scrape.
    """

    def __init__(self, config: EngineConfig, model_name: str, engine_index: int = 0) -> None:
        path = os.environ.get(MULTIPROC_DIR_ENV)
        if not path:
            raise RuntimeError(f"${MULTIPROC_DIR_ENV} must be set before prometheus_client loads")
        self._labels = (model_name, str(engine_index))
        self._max_model_len = config.scheduler.max_model_len
        self._define_request_metrics(token_count_buckets(self._max_model_len))
        self._define_engine_metrics(config)
        self._registry = CollectorRegistry(auto_describe=False)
        counters = [PREFIX + name for name in (*_ENGINE_COUNTERS, *_STEP_TIME_COUNTERS)]
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
        self._published: tuple[SchedulerStats | None, int] = (None, -1)

    # ------------------------------------------------------------------ definitions

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(PREFIX + name, doc, LABELS, registry=None).labels(*self._labels)

    def _histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        return Histogram(PREFIX + name, doc, LABELS, buckets=buckets, registry=None).labels(
            *self._labels
        )

    def _gauge(self, name: str, doc: str, mode: str, extra: Sequence[str] = ()) -> Gauge:
        """A gauge merged across frontends by ``mode``; the caller binds its labels."""
        return Gauge(PREFIX + name, doc, (*LABELS, *extra), registry=None, multiprocess_mode=mode)

    def _own_gauge(self, name: str, doc: str, mode: str) -> Gauge:
        """A gauge merged across frontends by ``mode``, bound to this frontend's labels."""
        return self._gauge(name, doc, mode).labels(*self._labels)

    def _define_request_metrics(self, token_buckets: list[int]) -> None:
        success = Counter(
            PREFIX + "request_success", "Finished requests (choices) by finish reason.",
            (*LABELS, "finished_reason"), registry=None,
        )  # fmt: skip
        self._success = {r: success.labels(*self._labels, r) for r in FINISH_REASONS}
        self._success_family = success
        self._prompt_tokens = self._counter("prompt_tokens", "Prompt tokens of requests prefilled.")
        self._generation_tokens = self._counter("generation_tokens", "Tokens generated.")
        self._unsaved_generation_tokens = 0
        h, latency = self._histogram, REQUEST_LATENCY_BUCKETS
        self._ttft = h("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self._itl = h("inter_token_latency_seconds", "Time between two outputs.", ITL_BUCKETS)
        self._tpot = h(
            "request_time_per_output_token_seconds",
            "Decode time per output token after the first, per request.",
            ITL_BUCKETS,
        )
        self._e2e = h("e2e_request_latency_seconds", "Arrival to finish, per request.", latency)
        self._queue = h("request_queue_time_seconds", "Time waiting in the engine.", latency)
        self._prefill = h(
            "request_prefill_time_seconds", "First scheduled to first token.", latency
        )
        self._decode = h("request_decode_time_seconds", "First to last token.", latency)
        self._inference = h("request_inference_time_seconds", "Prefill + decode.", latency)
        self._prompt_lengths = h(
            "request_prompt_tokens", "Prompt tokens, per request.", token_buckets
        )
        self._generation_lengths = h(
            "request_generation_tokens", "Generated tokens, per request.", token_buckets
        )
        self._max_tokens = h(
            "request_params_max_tokens", "The max_tokens a request asked for.", token_buckets
        )
        self._params_n = h("request_params_n", "The n of each prompt's request.", PARAMS_N_BUCKETS)
        self._max_generation = h(
            "request_max_num_generation_tokens",
            "Most tokens generated by one of a prompt's n choices.",
            token_buckets,
        )
        responses = Counter(
            PREFIX + "http_responses", "HTTP responses by status code.", ("model_name", "code"),
            registry=None,
        )  # fmt: skip
        self._responses = responses
        self._responses_by_code: dict[int, Counter] = {}

    def _define_engine_metrics(self, config: EngineConfig) -> None:
        labels, g, own = self._labels, self._gauge, self._own_gauge
        recent = "livemostrecent"
        self._running = own("num_requests_running", "Requests in the engine's batch.", recent)
        self._waiting = own("num_requests_waiting", "Requests waiting in the engine.", recent)
        self._kv_usage = own("kv_cache_usage_perc", "Fraction of KV cache blocks in use.", recent)
        self._engine_counts = {
            field: own(field, doc, "livemax") for field, doc in _ENGINE_COUNTERS.items()
        }
        for name, (field, doc) in _STEP_TIME_COUNTERS.items():
            self._engine_counts[field] = own(name, doc, "livemax")
        doc = "Tokens per engine step."
        bucket = g("iteration_tokens_total_bucket", doc, "livemax", ("le",))
        bounds = [*(str(float(b)) for b in ITERATION_TOKENS_BUCKETS), "+Inf"]
        self._iteration_buckets = [bucket.labels(*labels, le) for le in bounds]
        self._iteration_sum = own("iteration_tokens_total_sum", doc, "livemax")
        self._iteration_count = own("iteration_tokens_total_count", doc, "livemax")
        self._in_flight = own(
            "num_http_requests_in_flight", "Generation requests the frontends serve.", "livesum"
        )
        cache = config.cache
        info = {
            "block_size": str(cache.block_size),
            "enable_prefix_caching": str(cache.enable_prefix_caching),
            "num_gpu_blocks": str(cache.num_blocks),
            "gpu_memory_utilization": str(cache.gpu_memory_utilization),
            "kv_cache_memory_bytes": str(cache.kv_cache_memory),
        }
        g("cache_config_info", "The KV cache's configuration.", "livemax", tuple(info)).labels(
            *labels, *info.values()
        ).set(1)
        own("frontend_info", "One per live frontend process (labelled pid).", "liveall").set(1)

    # ------------------------------------------------------------------ what this frontend sees

    def observe_tokens(
        self, choice: ChoiceState, num_new_tokens: int, previous: float | None
    ) -> None:
        """An output of ``choice`` brought tokens; ``previous`` was its last token's time."""
        now = choice.last_token_time
        assert now is not None
        if previous is None:
            self._ttft.observe(now - choice.arrival_time)
            # The prompt counts once the engine has computed it, which its first token proves.
            self._prompt_tokens.inc(choice.num_prompt_tokens)
        else:
            self._itl.observe(now - previous)
        # Counted here, written to the shared files when the choice ends and at least once a
        # second (``publish``): a write per output would cost more than the rest of this method.
        self._unsaved_generation_tokens += num_new_tokens

    def _save_counts(self) -> None:
        if self._unsaved_generation_tokens:
            self._generation_tokens.inc(self._unsaved_generation_tokens)
            self._unsaved_generation_tokens = 0

    def observe_finished(
        self, choice: ChoiceState, reason: str, timings: RequestTimings | None
    ) -> None:
        """``choice`` ended (``reason``); ``timings`` came with its final engine output."""
        counter = self._success.get(reason)
        if counter is None:
            counter = self._success[reason] = self._success_family.labels(*self._labels, reason)
        counter.inc()
        self._save_counts()
        self._e2e.observe(time.monotonic() - choice.arrival_time)
        num_generated = len(choice.token_ids)
        self._prompt_lengths.observe(choice.num_prompt_tokens)
        self._generation_lengths.observe(num_generated)
        max_tokens = choice.sampling_params.max_tokens
        if max_tokens is None:  # until the context is full
            max_tokens = self._max_model_len - choice.num_prompt_tokens
        self._max_tokens.observe(max_tokens)
        if timings is not None:
            self._queue.observe(timings.queued)
            self._prefill.observe(timings.prefill)
            self._decode.observe(timings.decode)
            self._inference.observe(timings.prefill + timings.decode)
            if num_generated > 1:
                self._tpot.observe(timings.decode / (num_generated - 1))

    def observe_request(self, choices: Sequence[ChoiceState], n: int) -> None:
        """An HTTP request's choices all ended: per prompt, its n and its longest choice."""
        for start in range(0, len(choices), n):
            group = choices[start : start + n]
            self._params_n.observe(n)
            self._max_generation.observe(max(len(c.token_ids) for c in group))

    def observe_response(self, status: int) -> None:
        counter = self._responses_by_code.get(status)
        if counter is None:
            counter = self._responses.labels(self._labels[0], str(status))
            self._responses_by_code[status] = counter
        counter.inc()

    # ------------------------------------------------------------------ the engine's numbers

    def publish(self, stats: SchedulerStats | None, num_in_flight: int) -> None:
        """Write this frontend's copy of the engine's stats (and its requests in flight) where
        the other frontends' scrapes read them, if they changed since the last time; and the
        tokens counted since the last write."""
        self._save_counts()
        if stats is self._published[0] and num_in_flight == self._published[1]:
            return
        self._published = (stats, num_in_flight)
        self._in_flight.set(num_in_flight)
        if stats is None:
            return
        self._running.set(stats.num_running)
        self._waiting.set(stats.num_waiting)
        self._kv_usage.set(stats.kv_cache_usage)
        for field, gauge in self._engine_counts.items():
            gauge.set(getattr(stats, field))
        cumulative = 0
        counts = stats.iteration_tokens
        for i, gauge in enumerate(self._iteration_buckets):
            cumulative += counts[i] if i < len(counts) else 0
            gauge.set(cumulative)
        self._iteration_sum.set(stats.num_prompt_tokens + stats.num_generation_tokens)
        self._iteration_count.set(stats.num_steps)

    def render(self) -> bytes:
        """The whole server's metrics in Prometheus's text format, from every frontend's files
        (call ``publish`` first, on the event loop, to bring this frontend's own up to date).
        Reads files only, so it may run on another thread."""
        return generate_latest(self._registry)
