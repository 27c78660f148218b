"""What a scrape of /metrics returns: every frontend's files merged into the server's totals.

Runs in an HTTP frontend process, when /metrics is asked for. prometheus_client's
``MultiProcessCollector`` reads every process's files in the shared folder and merges them as
each metric's multiprocess mode says (counters and histograms summed, gauges by their mode).
The engine's cumulative counts travel between frontends as gauges merged by their maximum (see
``metrics``); here they are given back the type a dashboard expects: counters, and a histogram.
The process and garbage-collector metrics the library gives are those of the frontend that
answers, each series labelled with its ``pid`` so that two frontends never share one series.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample


@dataclass(frozen=True)
class Ratio:
    """A gauge computed at scrape time: ``numerator / denominator`` of two merged counters."""

    name: str
    documentation: str
    numerator: str
    denominator: str


class ServerCollector(Collector):
    """The merged metrics of every frontend whose files are in ``path``."""

    def __init__(
        self,
        path: str,
        counters: Sequence[str],
        histograms: Sequence[str],
        ratios: Sequence[Ratio] = (),
    ) -> None:
        """``counters``: gauges holding cumulative counts, exported as counters (``NAME`` ->
        ``NAME_total``); ``histograms``: histograms kept as three gauges (``NAME_bucket`` with
        cumulative ``le`` buckets, ``NAME_sum``, ``NAME_count``), exported as one histogram."""
        self._files = MultiProcessCollector(None, path)
        self._counters = tuple(counters)
        self._histograms = tuple(histograms)
        self._ratios = tuple(ratios)
        self._pid = str(os.getpid())
        # The library's own collectors of this process (its default registry's).
        self._own = (PROCESS_COLLECTOR, GC_COLLECTOR, PLATFORM_COLLECTOR)

    def collect(self) -> Iterator[Metric]:
        families = {metric.name: metric for metric in self._files.collect()}
        merged_counts: dict[str, list[Sample]] = {}
        for name in self._counters:
            family = families.pop(name, None)
            if family is not None:
                merged_counts[name] = family.samples
                yield _retyped(family, "counter", {name: name + "_total"})
        for name in self._histograms:
            parts = [families.pop(name + suffix, None) for suffix in ("_bucket", "_sum", "_count")]
            if all(part is not None for part in parts):
                yield _histogram(name, parts)  # type: ignore[arg-type]
        for ratio in self._ratios:
            yield _ratio(ratio, merged_counts)
        yield from families.values()
        for collector in self._own:
            for family in collector.collect():
                yield _with_label(family, "pid", self._pid)


def _retyped(family: Metric, typ: str, renames: Mapping[str, str]) -> Metric:
    metric = Metric(family.name, family.documentation, typ)
    for sample in family.samples:
        metric.add_sample(renames.get(sample.name, sample.name), sample.labels, sample.value)
    return metric


def _histogram(name: str, parts: Sequence[Metric]) -> Metric:
    bucket, total, count = parts
    metric = Metric(name, bucket.documentation, "histogram")
    # Buckets of one series together, in ascending order, then its sum and count.
    buckets = sorted(bucket.samples, key=lambda s: (_without(s.labels, "le"), _le(s.labels)))
    for sample in buckets:
        metric.add_sample(sample.name, sample.labels, sample.value)
    for sample in (*total.samples, *count.samples):
        metric.add_sample(sample.name, sample.labels, sample.value)
    return metric


def _ratio(ratio: Ratio, counts: Mapping[str, list[Sample]]) -> Metric:
    metric = Metric(ratio.name, ratio.documentation, "gauge")
    denominators = {_key(s.labels): s.value for s in counts.get(ratio.denominator, [])}
    for sample in counts.get(ratio.numerator, []):
        denominator = denominators.get(_key(sample.labels), 0.0)
        value = sample.value / denominator if denominator else 0.0
        metric.add_sample(ratio.name, sample.labels, value)
    return metric


def _with_label(family: Metric, name: str, value: str) -> Metric:
    metric = Metric(family.name, family.documentation, family.type, family.unit)
    for sample in family.samples:
        metric.add_sample(sample.name, {**sample.labels, name: value}, sample.value)
    return metric


def _key(labels: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


def _without(labels: Mapping[str, str], name: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in labels.items() if k != name))


def _le(labels: Mapping[str, str]) -> float:
    return float(labels["le"])
