"""The Grafana dashboard's panels, written once: the JSON Grafana imports and the queries the
capture renders come from this list.

    python -m benchmarks.observability.dashboard docs/observability/grafana.json

Runs in the user's process; imports nothing of the engine. Every query names conveyor's metrics
(vLLM's names with the ``conveyor:`` prefix) filtered by the dashboard's ``$model_name``
variable; ``$__rate_interval`` is Grafana's rate window.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SELECTOR = '{model_name="$model_name"}'
RATE = "[$__rate_interval]"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str = "none"
    # "timeseries", or "heatmap" for a histogram's buckets over time.
    kind: str = "timeseries"
    stacked: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def _metric(name: str, suffix: str = "") -> str:
    return f"conveyor:{name}{suffix}{SELECTOR}"


def quantiles(name: str, qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> tuple[Query, ...]:
    """Percentiles of a histogram over the rate window, and its mean."""
    bucket = f"rate({_metric(name, '_bucket')}{RATE})"
    found = [Query(f"histogram_quantile({q}, sum by (le) ({bucket}))", f"p{q * 100:g}") for q in qs]
    mean = f"sum(rate({_metric(name, '_sum')}{RATE})) / sum(rate({_metric(name, '_count')}{RATE}))"
    return (*found, Query(mean, "mean"))


def mean(name: str, legend: str) -> Query:
    total = f"sum(rate({_metric(name, '_sum')}{RATE}))"
    return Query(f"{total} / sum(rate({_metric(name, '_count')}{RATE}))", legend)


def rate(name: str, legend: str, by: str = "") -> Query:
    grouping = f" by ({by})" if by else ""
    return Query(f"sum{grouping}(rate({_metric(name)}{RATE}))", legend)


def heatmap(name: str) -> tuple[Query, ...]:
    return (Query(f"sum by (le) (increase({_metric(name, '_bucket')}{RATE}))", "{{le}}"),)


PANELS: tuple[Panel, ...] = (
    Panel("Requests finished", "Finished requests (choices) per second, by finish reason.",
          (rate("request_success_total", "{{finished_reason}}", "finished_reason"),), "reqps",
          stacked=True),
    Panel("Token throughput", "Prompt tokens prefilled and tokens generated per second.",
          (rate("prompt_tokens_total", "prompt"), rate("generation_tokens_total", "generation")),
          "short"),
    Panel("Time to first token", "From arrival at a frontend to the first token out.",
          quantiles("time_to_first_token_seconds"), "s"),
    Panel("Inter-token latency", "Time between two outputs of a request.",
          quantiles("inter_token_latency_seconds"), "s"),
    Panel("End-to-end latency", "From arrival to the last token, per request.",
          quantiles("e2e_request_latency_seconds"), "s"),
    Panel("Time per output token", "Each request's decode time per token after its first.",
          quantiles("request_time_per_output_token_seconds"), "s"),
    Panel("Scheduler state", "Requests in the engine's batch and waiting for it; generation "
          "requests the frontends serve.",
          (Query(f"sum(conveyor:num_requests_running{SELECTOR})", "running"),
           Query(f"sum(conveyor:num_requests_waiting{SELECTOR})", "waiting"),
           Query(f"sum(conveyor:num_http_requests_in_flight{SELECTOR})", "HTTP in flight"))),
    Panel("KV cache usage", "Fraction of the KV cache's blocks held by requests.",
          (Query(f"max(conveyor:kv_cache_usage_perc{SELECTOR})", "KV cache"),), "percentunit",
          extra={"max": 1}),
    Panel("Queue time", "How long requests waited in the engine before they first ran.",
          quantiles("request_queue_time_seconds"), "s"),
    Panel("Prefill and decode time", "Per request, mean over the window: first scheduled to "
          "first token (prefill), first to last token (decode), and both (inference).",
          (mean("request_prefill_time_seconds", "prefill"),
           mean("request_decode_time_seconds", "decode"),
           mean("request_inference_time_seconds", "inference")), "s"),
    Panel("Tokens per engine step", "Prompt and generated tokens each engine step computed.",
          quantiles("iteration_tokens_total"), "short"),
    Panel("Prefix cache hit rate", "Prompt tokens found in the prefix cache / looked up, over "
          "the window.",
          (Query(f"sum(rate(conveyor:prefix_cache_hits_total{SELECTOR}{RATE})) / "
                 f"sum(rate(conveyor:prefix_cache_queries_total{SELECTOR}{RATE}))", "hit rate"),),
          "percentunit"),
    Panel("Preemptions", "Requests sent back to wait for KV cache blocks, per second.",
          (rate("num_preemptions_total", "preemptions"),), "short"),
    Panel("Request prompt length", "Prompt tokens per request (heatmap of the histogram).",
          heatmap("request_prompt_tokens"), kind="heatmap"),
    Panel("Request generation length", "Generated tokens per request (heatmap).",
          heatmap("request_generation_tokens"), kind="heatmap"),
    Panel("Max generation tokens of a prompt's choices", "Per prompt: the longest of its n "
          "choices (mean), beside the max_tokens requests asked for (mean) and n (mean).",
          (mean("request_max_num_generation_tokens", "longest choice"),
           mean("request_params_max_tokens", "max_tokens asked"),
           mean("request_params_n", "n")), "short"),
    Panel("HTTP responses", "Responses per second by status code (499: the client left).",
          (rate("http_responses_total", "{{code}}", "code"),), "reqps", stacked=True),
    Panel("Frontends", "Live frontend processes.",
          (Query(f"count(conveyor:frontend_info{SELECTOR})", "frontends"),), "none"),
)  # fmt: skip


def _target(query: Query, ref: str) -> dict[str, Any]:
    return {
        "datasource": {"type": "prometheus", "uid": "${DS_PROMETHEUS}"},
        "editorMode": "code",
        "expr": query.expr,
        "legendFormat": query.legend,
        "range": True,
        "refId": ref,
    }


def _panel_json(panel: Panel, panel_id: int) -> dict[str, Any]:
    x, y = (panel_id - 1) % 2 * 12, (panel_id - 1) // 2 * 8
    body: dict[str, Any] = {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": {"type": "prometheus", "uid": "${DS_PROMETHEUS}"},
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "targets": [_target(q, chr(ord("A") + i)) for i, q in enumerate(panel.queries)],
    }
    if panel.kind == "heatmap":
        body["targets"][0]["format"] = "heatmap"
        body["options"] = {"calculate": False, "yAxis": {"unit": panel.unit}}
    else:
        custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if panel.stacked else 0}
        if panel.stacked:
            custom["stacking"] = {"mode": "normal", "group": "A"}
        defaults = {"unit": panel.unit, "custom": custom, **panel.extra}
        body["fieldConfig"] = {"defaults": defaults, "overrides": []}
        body["options"] = {"legend": {"displayMode": "list", "placement": "bottom"}}
    return body


def grafana_dashboard() -> dict[str, Any]:
    """The dashboard, as Grafana's JSON model (import it, pick the Prometheus data source)."""
    model_query = "label_values(conveyor:frontend_info, model_name)"
    return {
        "title": "conveyor",
        "uid": "conveyor-overview",
        "description": "conveyor's serving metrics (vLLM's, with the conveyor: prefix).",
        "editable": True,
        "schemaVersion": 39,
        "tags": ["conveyor", "llm"],
        "time": {"from": "now-15m", "to": "now"},
        "refresh": "10s",
        "templating": {
            "list": [
                {
                    "name": "DS_PROMETHEUS",
                    "label": "data source",
                    "type": "datasource",
                    "query": "prometheus",
                },
                {
                    "name": "model_name",
                    "label": "model",
                    "type": "query",
                    "refresh": 1,
                    "datasource": {"type": "prometheus", "uid": "${DS_PROMETHEUS}"},
                    "definition": model_query,
                    "query": {"query": model_query, "refId": "model_name"},
                },
            ]
        },  # fmt: skip
        "panels": [_panel_json(panel, i + 1) for i, panel in enumerate(PANELS)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.observability.dashboard", description=__doc__.split("\n")[0]
    )
    parser.add_argument("out", type=Path, help="where to write the dashboard JSON")
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(grafana_dashboard(), indent=2) + "\n")
    print(f"wrote {args.out} ({len(PANELS)} panels)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
