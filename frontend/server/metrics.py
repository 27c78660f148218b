"""The frontend's Prometheus metrics, written in the text exposition format by hand.

Runs in an HTTP frontend process. Request-level metrics (finish reasons, token counts, TTFT,
inter-token and end-to-end latency, HTTP status codes) are counted by this frontend, one engine
request (one choice) at a time, as vLLM counts them. Engine-level ones (running, waiting, KV
usage, preemptions, prefix cache) are the latest ``SchedulerStats`` this frontend's engine client
received: they describe the whole engine, whichever frontend is scraped.

Every series carries a ``pid`` label, this frontend's process id. Several frontends share one
port and each counts for itself, so successive scrapes land on different processes: without the
label one series would jump between their counts and seem to go backwards. With it each
frontend is its own series, and ``sum without (pid)`` adds them up.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence

from protocol import SchedulerStats

PREFIX = "conveyor:"

# Bucket bounds in seconds (vLLM's, trimmed at the long end).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip

FINISH_REASONS = ("stop", "length", "abort", "error", "rejected")


def _format_value(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    return repr(float(value)) if isinstance(value, float) else str(value)


def _labels(pairs: Sequence[tuple[str, str]]) -> str:
    if not pairs:
        return ""
    escaped = (
        (k, v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")) for k, v in pairs
    )
    return "{" + ",".join(f'{k}="{v}"' for k, v in escaped) + "}"


class Histogram:
    """Cumulative buckets, a sum and a count, as Prometheus histograms are."""

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        self.name = PREFIX + name
        self.help_text = help_text
        self.bounds = tuple(buckets)
        self.bucket_counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.bucket_counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, labels: Sequence[tuple[str, str]]) -> list[str]:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip((*self.bounds, float("inf")), self.bucket_counts):
            cumulative += count
            le = _labels((*labels, ("le", _format_value(bound))))
            lines.append(f"{self.name}_bucket{le} {cumulative}")
        lines.append(f"{self.name}_sum{_labels(labels)} {_format_value(self.sum)}")
        lines.append(f"{self.name}_count{_labels(labels)} {self.count}")
        return lines


def _scalar(kind: str, name: str, help_text: str, samples: list[tuple[str, float]]) -> list[str]:
    """A counter or gauge: ``samples`` are (rendered labels, value)."""
    full = PREFIX + name
    lines = [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]
    lines += [f"{full}{labels} {_format_value(value)}" for labels, value in samples]
    return lines


class ServerMetrics:
    """Everything /metrics reports for one frontend process."""

    def __init__(self, model_name: str, pid: int | None = None) -> None:
        pid = os.getpid() if pid is None else pid
        self._labels = (("model_name", model_name), ("pid", str(pid)))
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_in_flight = 0
        self.responses_by_status: dict[int, int] = {}
        self.ttft = Histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = Histogram(
            "inter_token_latency_seconds", "Time between consecutive outputs.", ITL_BUCKETS
        )
        self.e2e = Histogram(
            "e2e_request_latency_seconds", "Arrival to finish, per request.", E2E_BUCKETS
        )

    def observe_tokens(self, arrival: float, previous: float | None, now: float) -> None:
        """An output with tokens arrived at ``now``; ``previous`` is the choice's last one."""
        if previous is None:
            self.ttft.observe(now - arrival)
        else:
            self.itl.observe(now - previous)

    def observe_finished(
        self, finish_reason: str, arrival: float, now: float, num_prompt: int, num_generated: int
    ) -> None:
        self.finished[finish_reason] = self.finished.get(finish_reason, 0) + 1
        self.e2e.observe(now - arrival)
        self.num_prompt_tokens += num_prompt
        self.num_generation_tokens += num_generated

    def observe_response(self, status: int) -> None:
        self.responses_by_status[status] = self.responses_by_status.get(status, 0) + 1

    def render(self, stats: SchedulerStats | None) -> str:
        base = _labels(self._labels)
        lines = self._request_lines(base)
        for histogram in (self.ttft, self.itl, self.e2e):
            lines += histogram.render(self._labels)
        lines += self._engine_lines(base, stats or SchedulerStats())
        return "\n".join(lines) + "\n"

    def _request_lines(self, base: str) -> list[str]:
        by_reason = [
            (_labels((*self._labels, ("finished_reason", r))), n) for r, n in self.finished.items()
        ]
        by_status = [
            (_labels((*self._labels, ("code", str(code)))), n)
            for code, n in sorted(self.responses_by_status.items())
        ]
        return [
            *_scalar("gauge", "frontend_info", "This frontend process.", [(base, 1)]),
            *_scalar("counter", "request_success_total", "Finished requests by reason.", by_reason),
            *_scalar("counter", "prompt_tokens_total", "Prefill tokens processed.",
                     [(base, self.num_prompt_tokens)]),
            *_scalar("counter", "generation_tokens_total", "Generation tokens processed.",
                     [(base, self.num_generation_tokens)]),
            *_scalar("gauge", "num_http_requests_in_flight",
                     "Generation requests this frontend is serving.", [(base, self.num_in_flight)]),
            *_scalar("counter", "http_responses_total", "HTTP responses by status code.",
                     by_status),
        ]  # fmt: skip

    def _engine_lines(self, base: str, stats: SchedulerStats) -> list[str]:
        queries = stats.prefix_cache_queries
        hit_rate = stats.prefix_cache_hits / queries if queries else 0.0
        return [
            *_scalar("gauge", "num_requests_running", "Requests in the engine's running batch.",
                     [(base, stats.num_running)]),
            *_scalar("gauge", "num_requests_waiting", "Requests waiting in the engine.",
                     [(base, stats.num_waiting)]),
            *_scalar("gauge", "kv_cache_usage_perc", "Fraction of KV blocks held (1 = full).",
                     [(base, float(stats.kv_cache_usage))]),
            *_scalar("counter", "num_preemptions_total", "Preemptions since the engine started.",
                     [(base, stats.num_preemptions)]),
            *_scalar("counter", "prefix_cache_queries_total", "Prompt tokens looked up.",
                     [(base, queries)]),
            *_scalar("counter", "prefix_cache_hits_total", "Prompt tokens found cached.",
                     [(base, stats.prefix_cache_hits)]),
            *_scalar("gauge", "prefix_cache_hit_rate", "Hits / queries since the engine started.",
                     [(base, hit_rate)]),
        ]  # fmt: skip
