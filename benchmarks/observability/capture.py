"""The dashboard under load, captured: serve, scrape with a real Prometheus, render the panels.

    python -m benchmarks dashboard --model DIR --out docs/observability

Runs in the user's process. Starts ``conveyor serve`` (two frontends on one port) and a
Prometheus server (``prometheus`` on the PATH: Debian's package, or a release) that scrapes the
shared port every 2 s, drives the server with ``conveyor bench serve`` through phases of changing
load, then asks Prometheus for every query of every dashboard panel over the run (PromQL
evaluated by Prometheus itself, as Grafana would) and draws them as the dashboard lays them out:
``dashboard.png``, beside ``prometheus.yml`` (the scrape config, with the port users start on).
Grafana itself is not needed; where it is installed, import ``grafana.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.observability.dashboard import PANELS, Panel
from benchmarks.policy_study.server import free_port, served
from conveyor.frontend.engine_args import EngineArgs

SCRAPE_INTERVAL_S = 2
RATE_WINDOW = "10s"  # $__rate_interval: 4 scrapes, as Grafana's default for a 2 s interval
# (name, conveyor bench serve flags): each phase a different load, so the panels move.
PHASES: tuple[tuple[str, list[str]], ...] = (
    ("steady", ["--request-rate", "3", "--num-prompts", "60", "--random-input-len", "64",
                "--random-output-len", "64", "--random-range-ratio", "0.5"]),
    ("busy", ["--request-rate", "10", "--num-prompts", "200", "--random-input-len", "96",
              "--random-output-len", "96", "--random-range-ratio", "0.5"]),
    ("long prompts", ["--request-rate", "2", "--num-prompts", "40", "--random-input-len", "700",
                      "--random-output-len", "32", "--random-range-ratio", "0.3"]),
    ("shared prefix", ["--dataset-name", "prefix", "--prefix-len", "256", "--num-prefix-groups",
                       "4", "--random-input-len", "64", "--random-output-len", "48",
                       "--request-rate", "6", "--num-prompts", "120"]),
)  # fmt: skip

PROMETHEUS_CONFIG = """\
# Scrape every conveyor frontend through the port they share: any one answers for the whole
# server, so one target is enough however many frontends run.
global:
  scrape_interval: {interval}s
scrape_configs:
  - job_name: conveyor
    metrics_path: /metrics
    static_configs:
      - targets: ["{target}"]
"""


@contextlib.contextmanager
def prometheus(config: Path, data: Path, log: Path) -> Iterator[str]:
    """A Prometheus server on a free 127.0.0.1 port; yields its URL; always stopped."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise SystemExit("prometheus is not on the PATH (Debian: apt install prometheus)")
    port = free_port()
    command = [binary, f"--config.file={config}", f"--storage.tsdb.path={data}",
               f"--web.listen-address=127.0.0.1:{port}"]  # fmt: skip
    with log.open("w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30.0
        while not _answers(f"{url}/-/ready"):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not start; see {log}")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10.0)
        except subprocess.TimeoutExpired:
            process.kill()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return response.status == 200
    except OSError:
        return False


def run_phases(base_url: str, out: Path, tokenizer: str) -> list[tuple[str, float, float]]:
    """Each load phase in turn, with a short pause between; (name, start, end) in Unix time."""
    times = []
    for name, flags in PHASES:
        start = time.time()
        command = [sys.executable, "-m", "conveyor.entrypoints.cli", "bench", "serve", "--base-url",
                   base_url, "--tokenizer", tokenizer, "--no-progress", *flags,
                   "--result-json", str(out / f"load-{name.replace(' ', '-')}.json")]  # fmt: skip
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        times.append((name, start, time.time()))
        time.sleep(8.0)
    return times


def query_range(url: str, expr: str, start: float, end: float) -> list[dict[str, Any]]:
    expr = expr.replace("$__rate_interval", RATE_WINDOW)
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end,
                                     "step": SCRAPE_INTERVAL_S})  # fmt: skip
    with urllib.request.urlopen(f"{url}/api/v1/query_range?{params}", timeout=30) as response:
        body = json.load(response)
    if body["status"] != "success":
        raise RuntimeError(f"{expr}: {body}")
    return body["data"]["result"]


def capture_panels(url: str, model_name: str, start: float, end: float) -> list[dict[str, Any]]:
    """Every panel's queries, evaluated by Prometheus over [start, end]."""
    captured = []
    for panel in PANELS:
        series = []
        for query in panel.queries:
            expr = query.expr.replace("$model_name", model_name)
            for result in query_range(url, expr, start, end):
                legend = query.legend
                for key, value in result["metric"].items():
                    legend = legend.replace("{{" + key + "}}", value)
                points = [(float(t), float(v)) for t, v in result["values"]]
                series.append({"legend": legend, "points": points})
        captured.append({"title": panel.title, "series": series})
    return captured


def render(
    captured: list[dict[str, Any]], phases: list[tuple[str, float, float]], out: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    origin = phases[0][1]
    rows = (len(PANELS) + 2) // 3
    fig, axes = plt.subplots(rows, 3, figsize=(18, 3.2 * rows), constrained_layout=True)
    for ax, panel, data in zip(axes.flat, PANELS, captured):
        _draw(ax, panel, data["series"], origin)
        for _, start, end in phases:
            ax.axvspan(start - origin, end - origin, color="0.93", zorder=-1)
        ax.set_title(panel.title, fontsize=10, loc="left")
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(PANELS) :]:
        ax.axis("off")
    names = ", ".join(
        f"{name} {start - origin:.0f}-{end - origin:.0f} s" for name, start, end in phases
    )
    fig.suptitle(f"conveyor dashboard under load (grey: load phases: {names})", fontsize=11)
    fig.savefig(out, dpi=80)


def _draw(ax: Any, panel: Panel, series: list[dict[str, Any]], origin: float) -> None:
    finite = [s for s in series if any(v == v and abs(v) != float("inf") for _, v in s["points"])]
    if panel.kind == "heatmap":
        _draw_heatmap(ax, finite, origin)
        return
    for s in finite:
        xs = [t - origin for t, _ in s["points"]]
        ys = [v for _, v in s["points"]]
        ax.plot(xs, ys, label=s["legend"], linewidth=1)
    if finite:
        ax.legend(fontsize=7, loc="upper right")
    if panel.unit == "percentunit":
        ax.yaxis.set_major_formatter(lambda v, _: f"{100 * v:.0f}%")
    elif panel.unit != "none":
        ax.set_ylabel(panel.unit, fontsize=8)
    ax.set_xlabel("s", fontsize=8)


def _draw_heatmap(ax: Any, series: list[dict[str, Any]], origin: float) -> None:
    import numpy as np

    bounds = sorted(series, key=lambda s: float(s["legend"]))
    if not bounds:
        return
    times = sorted({t for s in bounds for t, _ in s["points"]})
    index = {t: i for i, t in enumerate(times)}
    grid = np.zeros((len(bounds), len(times)))
    previous = np.zeros(len(times))
    for row, s in enumerate(bounds):  # cumulative buckets -> counts per bucket
        column = np.zeros(len(times))
        for t, v in s["points"]:
            column[index[t]] = v
        grid[row] = np.maximum(column - previous, 0)
        previous = column
    labels = [s["legend"] for s in bounds]
    extent = (times[0] - origin, times[-1] - origin, 0, len(bounds))
    ax.imshow(np.log1p(grid), aspect="auto", origin="lower", extent=extent, cmap="magma_r")
    ax.set_yticks([i + 0.5 for i in range(len(labels))][::2], labels[::2], fontsize=6)
    ax.set_xlabel("s", fontsize=8)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks dashboard", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    parser.add_argument("--out", type=Path, default=Path("docs/observability"))
    parser.add_argument("--max-model-len", type=int, default=1024)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    engine = EngineArgs(model=args.model, max_model_len=args.max_model_len, max_num_seqs=64,
                        max_num_batched_tokens=512, kv_cache_memory=64 << 20)  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="conveyor-capture-"))
    try:
        with served(engine, work / "serve.log", extra=["--frontends", "2"]) as base_url:
            config = args.out / "prometheus.yml"
            target = base_url.removeprefix("http://")
            config.write_text(PROMETHEUS_CONFIG.format(interval=SCRAPE_INTERVAL_S, target=target))
            with prometheus(config, work / "tsdb", work / "prometheus.log") as url:
                time.sleep(3 * SCRAPE_INTERVAL_S)
                phases = run_phases(base_url, work, args.model)
                time.sleep(2 * SCRAPE_INTERVAL_S)
                start, end = phases[0][1] - 10.0, time.time()
                captured = capture_panels(url, args.model, start, end)
        # The file users copy names a port of their own, not this run's.
        config.write_text(PROMETHEUS_CONFIG.format(interval=5, target="127.0.0.1:8000"))
        render(captured, phases, args.out / "dashboard.png")
        print(f"wrote {args.out / 'dashboard.png'} ({len(PANELS)} panels, {end - start:.0f} s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
