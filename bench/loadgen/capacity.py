"""Serving capacity: the highest request rate whose p99 inter-token latency holds an SLO.

Runs in the load generator's process (conveyor bench serve --capacity-search). This is
Sarathi-Serve's capacity metric: each probe is a short run at one request rate; a probe holds
when no request failed, the p99 ITL (time between tokens, TBT) is within the SLO and, when a
median TTFT bound is given, the median TTFT is within it. The TBT SLO alone does not bound
queueing: a policy that makes new requests wait (static batching) keeps TBT low at any rate while
TTFT grows without limit. The TTFT bound stands in for Sarathi-Serve's median scheduling-delay
bound, which a client cannot see apart from the prefill. The search first brackets the answer
(doubling up from --capacity-start-rate while probes hold, halving down while they do not), then
bisects between the highest rate that held and the lowest that did not, until they are within
--capacity-tolerance of each other or the probes run out.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class CapacitySpec:
    slo_itl_p99_ms: float
    slo_ttft_median_ms: float | None = None  # None: queueing is not bounded
    start_rate: float = 1.0
    min_rate: float = 0.05
    max_rate: float = 1000.0
    max_probes: int = 12
    tolerance: float = 0.05  # relative gap between held and broke at which the search stops


@dataclass(frozen=True)
class Probe:
    """One probe's rate and the numbers that decided it."""

    request_rate: float
    holds: bool
    p99_itl_ms: float
    median_ttft_ms: float
    completed: int
    failed: int
    request_throughput: float
    output_throughput: float
    mean_e2el_ms: float
    # Why requests failed ("HTTP 500: ...": count), so a probe broken by failures says by what.
    failure_reasons: dict[str, int] = field(default_factory=dict)

    def line(self, number: int) -> str:
        verdict = "holds" if self.holds else "BREAKS"
        text = (
            f"probe {number:2d}: rate {self.request_rate:9.3f} req/s -> p99 ITL "
            f"{self.p99_itl_ms:9.2f} ms, median TTFT {self.median_ttft_ms:9.2f} ms, "
            f"completed {self.completed}, failed {self.failed}, "
            f"{self.request_throughput:.2f} req/s, {self.output_throughput:.1f} tok/s: {verdict}"
        )
        for reason, count in self.failure_reasons.items():
            text += f"\n    {count} x {reason}"
        return text


@dataclass(frozen=True)
class CapacityResult:
    capacity: float | None  # None: no probe held (or none finished)
    is_lower_bound: bool  # no probe broke the SLO (max rate or probes reached): at least this
    probes: list[Probe]
    interrupted: bool = False  # stopped early (Ctrl-C): capacity is the best rate seen so far

    def as_dict(self) -> dict[str, Any]:
        return {
            "capacity_request_rate": self.capacity,
            "capacity_is_lower_bound": self.is_lower_bound,
            "capacity_interrupted": self.interrupted,
            "capacity_probes": [asdict(p) for p in self.probes],
        }


class SearchStopped(Exception):
    """Raised by a probe run that was stopped: the search ends with what it knows."""


ProbeRun = Callable[[float], Awaitable[dict[str, Any]]]  # rate -> metrics.summarize()


def make_probe(rate: float, result: dict[str, Any], spec: CapacitySpec) -> Probe:
    """One probe's verdict from its run's summary (metrics.summarize())."""
    ttft_bound = spec.slo_ttft_median_ms
    holds = (
        result["failed"] == 0
        and result["completed"] > 0
        and result["p99_itl_ms"] <= spec.slo_itl_p99_ms
        and (ttft_bound is None or result["median_ttft_ms"] <= ttft_bound)
    )
    return Probe(
        request_rate=rate,
        holds=holds,
        p99_itl_ms=result["p99_itl_ms"],
        median_ttft_ms=result["median_ttft_ms"],
        completed=result["completed"],
        failed=result["failed"],
        request_throughput=result["request_throughput"],
        output_throughput=result["output_throughput"],
        mean_e2el_ms=result["mean_e2el_ms"],
        failure_reasons=dict(result.get("failure_reasons") or {}),
    )


class _Search:
    """The bracket so far: the highest rate that held and the lowest that broke."""

    def __init__(self, run_probe: ProbeRun, spec: CapacitySpec, report: Callable[[str], None]):
        self.run_probe, self.spec, self.report = run_probe, spec, report
        self.probes: list[Probe] = []
        self.held: float | None = None
        self.broke: float | None = None

    async def probe(self, rate: float) -> bool:
        result = await self.run_probe(rate)
        self.probes.append(make_probe(rate, result, self.spec))
        self.report(self.probes[-1].line(len(self.probes)))
        if self.probes[-1].holds:
            self.held = rate if self.held is None else max(self.held, rate)
        else:
            self.broke = rate if self.broke is None else min(self.broke, rate)
        return self.probes[-1].holds

    def probes_left(self) -> bool:
        return len(self.probes) < self.spec.max_probes

    async def bracket(self) -> None:
        """Double up while probes hold, halve down while they break, until both are seen."""
        spec = self.spec
        rate = min(max(spec.start_rate, spec.min_rate), spec.max_rate)
        while self.probes_left():
            if await self.probe(rate):
                if self.broke is not None or rate >= spec.max_rate:
                    return
                rate = min(rate * 2, spec.max_rate)
            else:
                if self.held is not None or rate <= spec.min_rate:
                    return
                rate = max(rate / 2, spec.min_rate)

    async def bisect(self) -> None:
        while self.held is not None and self.broke is not None and self.probes_left():
            if (self.broke - self.held) / self.broke <= self.spec.tolerance:
                return
            await self.probe((self.held + self.broke) / 2)


async def search_capacity(
    run_probe: ProbeRun, spec: CapacitySpec, report: Callable[[str], None] = print
) -> CapacityResult:
    """Bracket, then bisect; ``report`` gets one line per probe."""
    search = _Search(run_probe, spec, report)
    interrupted = False
    try:
        await search.bracket()
        await search.bisect()
    except SearchStopped:
        interrupted = True
    lower_bound = search.broke is None and search.held is not None
    return CapacityResult(search.held, lower_bound, search.probes, interrupted)
