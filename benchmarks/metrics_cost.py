"""What the Prometheus metrics cost: the load generator's output tok/s with metrics on and off.

Starts two servers side by side on one model (the embedded default unless ``--model``), one as
``conveyor serve`` runs by default (metrics recorded for every output, scraped every
``--scrape-interval-s`` as Prometheus would) and one with ``--disable-metrics``, and drives them
in turn with ``conveyor bench serve`` (closed loop, ``--max-concurrency`` streams), alternating
which goes first each round, so both see the same machine state. A small model makes the
frontend, where the metrics are recorded, as large a share of the work as it can be. Usage::

    python -m benchmarks metrics [--model DIR] [--rounds 5] [--num-prompts 512] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.policy_study.server import served
from conveyor.bench.machine import machine_info, print_report_start, tree_cpu_seconds
from conveyor.frontend.engine_args import DEFAULT_MODEL_DIR, EngineArgs
from conveyor.runtime.processes import descendants

SIDES = ("metrics on", "--disable-metrics")


@contextlib.contextmanager
def scraping(base_url: str, interval_s: float) -> Iterator[list[int]]:
    """GET /metrics every ``interval_s`` in a thread; yields the sizes of the scrapes."""
    sizes: list[int] = []
    stop = threading.Event()

    def scrape() -> None:
        while not stop.wait(interval_s):
            with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
                sizes.append(len(response.read()))

    thread = threading.Thread(target=scrape, daemon=True)
    thread.start()
    try:
        yield sizes
    finally:
        stop.set()
        thread.join(15.0)


def frontend_pid(supervisor_pid: int) -> int:
    """The server's one ``python -m conveyor.frontend`` process."""
    for pid in descendants(supervisor_pid):
        with contextlib.suppress(OSError):
            if b"\0frontend\0" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    raise RuntimeError(f"no frontend below pid {supervisor_pid}")


def load(base_url: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "conveyor.entrypoints.cli", "bench", "serve", "--base-url", base_url,
               "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
               "--random-input-len", str(args.input_len), "--random-output-len",
               str(args.output_len), "--request-rate", "inf", "--no-progress",
               "--result-json", str(out)]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = str(args.model or DEFAULT_MODEL_DIR)
    engine = EngineArgs(model=model, max_model_len=512, max_num_seqs=args.concurrency,
                        max_num_batched_tokens=2048, kv_cache_memory=256 << 20)  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="conveyor-bench-metrics-"))
    rates: dict[str, list[float]] = {side: [] for side in SIDES}
    # The frontend's CPU per 1,000 output tokens: where the metrics are recorded, and far less
    # noisy than throughput on a shared machine.
    frontend_cpu: dict[str, list[float]] = {side: [] for side in SIDES}
    scrape_bytes: list[int] = []
    supervisors: list[int] = []
    with (
        served(engine, work / "on.log", started=supervisors) as with_metrics,
        served(
            engine, work / "off.log", extra=["--disable-metrics"], started=supervisors
        ) as without,
    ):
        urls = dict(zip(SIDES, (with_metrics, without)))
        frontends = {side: frontend_pid(pid) for side, pid in zip(SIDES, supervisors)}
        load(with_metrics, args, work / "warmup.json")  # first-use costs, off the books
        load(without, args, work / "warmup.json")
        for round_index in range(args.rounds):
            order = SIDES if round_index % 2 == 0 else SIDES[::-1]
            for side in order:
                out = work / f"{round_index}-{side.strip('-')}.json"
                cpu_before = tree_cpu_seconds(frontends[side])
                if side == SIDES[0]:
                    with scraping(urls[side], args.scrape_interval_s) as sizes:
                        result = load(urls[side], args, out)
                    scrape_bytes += sizes
                else:
                    result = load(urls[side], args, out)
                cpu = tree_cpu_seconds(frontends[side]) - cpu_before
                assert result["failed"] == 0, result
                rates[side].append(result["output_throughput"])
                frontend_cpu[side].append(1000 * cpu / result["total_output_tokens"])
    on, off = rates[SIDES[0]], rates[SIDES[1]]
    return {
        "machine": machine_info(),
        "config": {"model": model, "rounds": args.rounds, "num_prompts": args.num_prompts,
                   "max_concurrency": args.concurrency, "input_len": args.input_len,
                   "output_len": args.output_len, "scrape_interval_s": args.scrape_interval_s},
        "output_tok_per_s": rates,
        "mean": {side: statistics.mean(values) for side, values in rates.items()},
        "median": {side: statistics.median(values) for side, values in rates.items()},
        "ratio_of_means": statistics.mean(on) / statistics.mean(off),
        "ratio_of_medians": statistics.median(on) / statistics.median(off),
        "pairwise_ratios": [a / b for a, b in zip(on, off)],
        "frontend_cpu_s_per_1k_tokens": frontend_cpu,
        "frontend_cpu_ratio_of_means": statistics.mean(frontend_cpu[SIDES[0]])
        / statistics.mean(frontend_cpu[SIDES[1]]),
        "scrape_bytes": max(scrape_bytes, default=0),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks metrics", description=__doc__)
    parser.add_argument("--model", type=Path, help="model directory (default: the embedded one)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--scrape-interval-s", type=float, default=5.0)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    report = run(args)
    if print_report_start(report, args.json):
        return 0
    for side in SIDES:
        values = " ".join(f"{v:.0f}" for v in report["output_tok_per_s"][side])
        cpu = statistics.mean(report["frontend_cpu_s_per_1k_tokens"][side])
        print(f"{side:<18} out tok/s {values}  mean {report['mean'][side]:.0f}; "
              f"frontend CPU {1000 * cpu:.1f} ms per 1k tokens")  # fmt: skip
    print(f"metrics on / off: {report['ratio_of_means']:.3f} (means), "
          f"{report['ratio_of_medians']:.3f} (medians); frontend CPU per token "
          f"{report['frontend_cpu_ratio_of_means']:.3f}x; a scrape is {report['scrape_bytes']} B")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
