"""The load generator's --plot: latency CDFs and output throughput over time, as one PNG.

Runs in the load generator's process after a run. matplotlib is imported here only, and only
when a plot is asked for, with the Agg backend (no display needed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from conveyor.bench.loadgen.client import RequestOutput
from conveyor.bench.loadgen.metrics import output_tokens_per_second, request_tpot
from conveyor.bench.loadgen.runner import RunResult


def write_plot(run: RunResult, path: str | Path, title: str = "") -> Path:
    """TTFT, TPOT/ITL and E2E latency CDFs, and output tokens per 1 s bin, in a 2x2 figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [o for o in run.outputs if o.success]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    _cdf(axes[0][0], {"TTFT": [o.ttft for o in done]}, "Time to first token")
    _cdf(
        axes[0][1],
        {
            "TPOT": [request_tpot(o) for o in done if o.output_tokens > 1],
            "ITL": [gap for o in done for gap in o.itl],
        },
        "Time per output token / inter-token latency",
    )
    _cdf(axes[1][0], {"E2E": [o.latency for o in done]}, "End-to-end latency")
    _throughput(axes[1][1], done, run.start_time)
    fig.suptitle(title or f"{len(done)} completed requests in {run.duration:.1f} s")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _cdf(axis: Any, series: dict[str, list[float]], title: str) -> None:
    for label, seconds in series.items():
        if not seconds:
            continue
        values = np.sort(np.asarray(seconds) * 1000.0)
        axis.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=label)
    axis.set_title(title)
    axis.set_xlabel("ms")
    axis.set_ylabel("fraction of requests" if len(series) == 1 else "fraction")
    axis.set_ylim(0, 1.02)
    axis.grid(alpha=0.3)
    if len(series) > 1:
        axis.legend()


def _throughput(axis: Any, done: list[RequestOutput], start: float) -> None:
    per_second = output_tokens_per_second(done, start)
    axis.bar(np.arange(len(per_second)), per_second, width=1.0, align="edge")
    axis.set_title("Output throughput over time (1 s bins)")
    axis.set_xlabel("seconds since the start")
    axis.set_ylabel("tokens / s")
    axis.grid(alpha=0.3)
