"""The SLO-aware token budget (``--tbt-slo-ms``) against fixed token budgets, on two models.

    python -m benchmarks policy-study --adaptive          # bench and small: about half an hour
    python -m benchmarks policy-study --adaptive --smoke  # the tiny model, a minute

Runs in the policy study's process; the servers it measures are its children. Per model, one
``conveyor serve`` per setup, all up at once: stall-free with each fixed token budget, and
``adaptive`` (stall-free with ``--tbt-slo-ms`` at the SLO and the default 2048-token budget as
its hard cap; it is told nothing about the model). Then:

1. Every setup's serving capacity under the study's SLO (p99 TBT, median TTFT, no failure), the
   searches interleaved: one probe at a time, round robin over the setups (an asyncio lock is
   FIFO), so load from other jobs on a shared machine hits every setup alike.
2. ``adaptive``'s p99 TBT at fractions of its capacity.
3. A run with changing load against a fresh ``adaptive`` server with ``--trace-steps``: the
   token budget it chose and the measured step time, step by step (the plot).

The TBT SLO is the study's (calibrated on ``bench``, 1.5x a full 256-token step) and the same
number of milliseconds for both models, as a promise to clients would be. Writes
adaptive.json, adaptive.md and the PNGs it links into --out (``adaptive_report``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.policy_study.adaptive_report import write_adaptive_report
from benchmarks.policy_study.server import served
from benchmarks.policy_study.study import PRESETS, StudyConfig, calibrate_slo, engine_args
from conveyor.bench.loadgen.capacity import CapacitySpec, make_probe, search_capacity
from conveyor.bench.loadgen.client import Endpoint
from conveyor.bench.loadgen.datasets import DatasetSpec, PromptMaker, load_tokenizer, make_dataset
from conveyor.bench.loadgen.main import run_async
from conveyor.bench.loadgen.metrics import summarize
from conveyor.bench.loadgen.ready import first_model
from conveyor.bench.loadgen.runner import TrafficSpec, open_session, run_requests
from conveyor.bench.machine import Timing, machine_info

ADAPTIVE = "adaptive"


@dataclass(frozen=True)
class AdaptiveConfig:
    study: StudyConfig = PRESETS["default"]
    models: tuple[str, ...] = ("bench", "small")
    budgets: tuple[int, ...] = (128, 256, 512, 1024, 2048)
    # adaptive's hard cap (the engine's default budget).
    adaptive_cap: int = 2048
    # The searches start at and go up to these rates per model (a small model holds more load,
    # so its search starts higher and spends no probes where every setup holds; the defaults
    # for others), with one probe more than the study's.
    capacity_rates: tuple[tuple[str, float, float], ...] = (
        ("bench", 3.0, 32.0),
        ("small", 12.0, 64.0),
    )
    capacity_max_rate: float = 32.0
    capacity_start_rate: float = 3.0
    capacity_max_probes: int = 7
    num_warmups: int = 8
    # A probe that breaks while other processes kept more than this share of the cores busy
    # runs again, at most this many times (the machine is shared with other jobs).
    busy_load: float = 0.2
    busy_retries: int = 2
    # adaptive's p99 TBT is measured at these fractions of its capacity.
    tbt_fractions: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)
    # The changing load: (fraction of adaptive's capacity, seconds), back to back.
    load_phases: tuple[tuple[float, float], ...] = (
        (0.25, 10.0),
        (1.0, 10.0),
        (1.5, 6.0),
        (0.5, 10.0),
    )


PRESETS_ADAPTIVE = {
    "default": AdaptiveConfig(),
    "smoke": AdaptiveConfig(
        study=PRESETS["smoke"],
        models=("tiny",),
        budgets=(32, 64),
        adaptive_cap=256,
        capacity_max_rate=8.0,
        capacity_start_rate=8.0,
        capacity_max_probes=1,
        num_warmups=2,
        tbt_fractions=(0.5, 1.0),
        load_phases=((0.5, 1.0), (1.0, 1.0)),
    ),
}


def setup_args(config: AdaptiveConfig, model: str, label: str, slo_ms: float, **extra: Any):
    study = config.study
    args = engine_args(study, model, "stall-free", max_num_seqs=study.online_max_num_seqs)
    if label == ADAPTIVE:
        return dataclasses.replace(
            args, max_num_batched_tokens=config.adaptive_cap, tbt_slo_ms=slo_ms, **extra
        )
    return dataclasses.replace(args, max_num_batched_tokens=int(label), **extra)


def search_rates(config: AdaptiveConfig, size: str) -> tuple[float, float]:
    """(start, max) of the capacity searches on this model."""
    rates = {name: (start, most) for name, start, most in config.capacity_rates}
    return rates.get(size, (config.capacity_start_rate, config.capacity_max_rate))


class Prober:
    """Sends one probe's requests to one server: the study's sharegpt-like workload."""

    def __init__(
        self, config: AdaptiveConfig, model: str, session: Any, rates: tuple[float, float]
    ) -> None:
        study = config.study
        self.config, self.session = config, session
        self.start_rate, self.max_rate = rates
        self.dataset = DatasetSpec(
            name="sharegpt-like",
            sharegpt_input_mean=study.sharegpt_input_mean,
            sharegpt_output_mean=study.sharegpt_output_mean,
            sharegpt_max_len=study.sharegpt_max_len,
        )
        self.maker = PromptMaker(load_tokenizer(model), endpoint_takes_ids=True)
        most = round(self.max_rate * study.capacity_probe_s) + 1
        self.num_prompts = max(most, study.capacity_min_requests, 2)
        self.stop = asyncio.Event()

    async def endpoint(self, url: str) -> Endpoint:
        endpoint = Endpoint(url, "")
        name = await first_model(self.session, endpoint, self.stop, 60.0)
        return dataclasses.replace(endpoint, model=name)

    async def warm_up(self, endpoint: Endpoint) -> None:
        samples = make_dataset(self.dataset, self.config.num_warmups, 10_000, self.maker)
        await run_requests(self.session, endpoint, samples, TrafficSpec(), self.stop, False)

    async def probe(
        self, endpoint: Endpoint, rate: float, seed: int, duration_s: float | None = None
    ) -> dict[str, Any]:
        study = self.config.study
        duration = study.capacity_probe_s if duration_s is None else duration_s
        samples = make_dataset(self.dataset, self.num_prompts, study.seed + seed, self.maker)
        traffic = TrafficSpec(
            request_rate=rate,
            duration_s=duration,
            seed=study.seed + seed,
            min_requests=study.capacity_min_requests if duration_s is None else 0,
        )
        with Timing() as timing:
            run = await run_requests(self.session, endpoint, samples, traffic, self.stop, False)
        return {**summarize(run, {}, (50.0, 99.0)), "other_load": timing.summary()["other_load"]}


async def interleaved_capacities(
    prober: Prober, endpoints: dict[str, Endpoint], slo_ms: float
) -> dict[str, dict[str, Any]]:
    """Every setup's capacity search, one probe at a time in round robin."""
    study = prober.config.study
    spec = CapacitySpec(
        slo_itl_p99_ms=slo_ms,
        slo_ttft_median_ms=study.slo_ttft_median_ms,
        start_rate=prober.start_rate,
        max_rate=prober.max_rate,
        max_probes=prober.config.capacity_max_probes,
        tolerance=study.capacity_tolerance,
    )
    turn = asyncio.Lock()
    loads: dict[str, list[float]] = {label: [] for label in endpoints}
    retries: dict[str, int] = {label: 0 for label in endpoints}

    def run_probe(label: str):
        num_probes = 0

        async def probe(rate: float) -> dict[str, Any]:
            nonlocal num_probes
            num_probes += 1
            for _ in range(1 + prober.config.busy_retries):
                async with turn:
                    result = await prober.probe(endpoints[label], rate, num_probes)
                loads[label].append(result["other_load"])
                busy = result["other_load"] > prober.config.busy_load
                if make_probe(rate, result, spec).holds or not busy:
                    break
                # Other jobs took the cores during a probe that broke: it says little about
                # this setup, so it runs again (in its turn), up to busy_retries times.
                retries[label] += 1
                print(f"{label:>9}: probe broke with other load {result['other_load']:.2f}: "
                      "again", file=sys.stderr, flush=True)  # fmt: skip
            return result

        return probe

    def report(label: str):
        return lambda line: print(f"{label:>9}: {line}", file=sys.stderr, flush=True)

    found = await asyncio.gather(
        *(search_capacity(run_probe(label), spec, report(label)) for label in endpoints)
    )
    return {
        label: {**result.as_dict(), "other_load": loads[label], "busy_retries": retries[label]}
        for label, result in zip(endpoints, found)
    }


async def measure_model(
    config: AdaptiveConfig,
    model: str,
    urls: dict[str, str],
    slo_ms: float,
    rates: tuple[float, float],
) -> dict[str, Any]:
    async with open_session(None, 600.0) as session:
        prober = Prober(config, model, session, rates)
        endpoints = {label: await prober.endpoint(url) for label, url in urls.items()}
        for label, endpoint in endpoints.items():
            print(f"warm-up: {label}", file=sys.stderr, flush=True)
            await prober.warm_up(endpoint)
        capacities = await interleaved_capacities(prober, endpoints, slo_ms)
        capacity = capacities[ADAPTIVE]["capacity_request_rate"] or 0.0
        sweep = []
        for i, fraction in enumerate(config.tbt_fractions):
            rate = max(capacity * fraction, 0.25)
            result = await prober.probe(endpoints[ADAPTIVE], rate, 100 + i)
            sweep.append({"fraction": fraction, "request_rate": rate, **_row(result)})
            print(f"adaptive at {rate:.2f} req/s: p99 TBT {result['p99_itl_ms']:.0f} ms",
                  file=sys.stderr, flush=True)  # fmt: skip
    return {"capacities": capacities, "tbt_sweep": sweep}


async def changing_load(config: AdaptiveConfig, model: str, url: str, capacity: float):
    """The load phases back to back; each phase's start and rate (study-side clock)."""
    phases = []
    async with open_session(None, 600.0) as session:
        prober = Prober(config, model, session, (capacity, 1.5 * capacity))
        endpoint = await prober.endpoint(url)
        started = time.monotonic()
        for i, (fraction, seconds) in enumerate(config.load_phases):
            rate = max(capacity * fraction, 0.25)
            phase_start = time.monotonic() - started
            result = await prober.probe(endpoint, rate, 200 + i, duration_s=seconds)
            phases.append({"start_s": phase_start, "request_rate": rate, **_row(result)})
    return phases


def _row(result: dict[str, Any]) -> dict[str, Any]:
    keys = ("completed", "failed", "median_ttft_ms", "p99_itl_ms", "median_itl_ms")
    return {key: result[key] for key in (*keys, "request_throughput", "other_load")}


def run_model(config: AdaptiveConfig, size: str, slo_ms: float, out: Path) -> dict[str, Any]:
    from benchmarks.fixtures.model_maker import ensure_model

    model = str(ensure_model(size))
    labels = [str(b) for b in config.budgets] + [ADAPTIVE]
    with contextlib.ExitStack() as stack:
        urls = {}
        for label in labels:
            print(f"{size}: starting {label}", file=sys.stderr, flush=True)
            args = setup_args(config, model, label, slo_ms)
            urls[label] = stack.enter_context(served(args, out / f"serve_{size}_{label}.log"))
        rates = search_rates(config, size)
        measured = run_async(measure_model(config, model, urls, slo_ms, rates))
    capacity = measured["capacities"][ADAPTIVE]["capacity_request_rate"] or 1.0
    trace = out / f"adaptive_trace_{size}.jsonl"
    trace.unlink(missing_ok=True)
    args = setup_args(config, model, ADAPTIVE, slo_ms, trace_steps=str(trace))
    with served(args, out / f"serve_{size}_adaptive_trace.log") as url:
        phases = run_async(changing_load(config, model, url, capacity))
    return {
        "size": size,
        "model": model,
        "capacity_start_rate": rates[0],
        "capacity_max_rate": rates[1],
        **measured,
        "load_phases": phases,
        "trace": trace.name,
    }


def main(
    smoke: bool,
    out: Path,
    slo_tbt_p99_ms: float | None,
    argv: list[str],
    models: list[str] | None = None,
) -> int:
    config = PRESETS_ADAPTIVE["smoke" if smoke else "default"]
    if models:
        config = dataclasses.replace(config, models=tuple(models))
    if slo_tbt_p99_ms is not None:
        config = dataclasses.replace(
            config, study=dataclasses.replace(config.study, slo_tbt_p99_ms=slo_tbt_p99_ms)
        )
    out.mkdir(parents=True, exist_ok=True)
    with Timing() as timing:
        from benchmarks.fixtures.model_maker import ensure_model

        slo = calibrate_slo(config.study, str(ensure_model(config.models[0])), out)
        print(f"TBT SLO: {slo['slo_tbt_p99_ms']:g} ms", file=sys.stderr, flush=True)
        models = [run_model(config, size, slo["slo_tbt_p99_ms"], out) for size in config.models]
    results = {
        "command": " ".join(["python -m benchmarks policy-study", *argv]),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "seconds": timing.seconds,
        "machine": machine_info(),
        "config": dataclasses.asdict(config),
        "slo": slo,
        "models": models,
    }
    (out / "adaptive.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"report: {write_adaptive_report(out, results)}")
    return 0
