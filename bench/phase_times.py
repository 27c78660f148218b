"""Where an in-process engine's time goes, by phase: `conveyor bench offline --phase-times`.

Runs in the benchmark's process, around an in-process engine (scheduler, runner and model all in
it, so one set of wrappers sees every phase). Each phase is a method, wrapped for the timed run
by a `perf_counter` pair (about a microsecond per call, a few thousand calls a run) and restored
after. The phases nest: `execute` (the runner's step) holds `forward` and `sample`, `forward`
holds the decoder's `linears` and the `attention` kernel. Attention is timed on the compiled CPU
kernel only (the torch fallback's attention is not a phase); on a GPU the wrappers would time
kernel launches, not kernels, so this is a CPU tool.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator


def _phases() -> list[tuple[str, type, str]]:
    from conveyor.engine_core.scheduler import Scheduler
    from conveyor.worker.attention.cpu_kernel import PagedAttentionKernel
    from conveyor.worker.input_batch import InputBatch
    from conveyor.worker.layers.linear import LinearBase
    from conveyor.worker.model_runner import ModelRunner
    from conveyor.worker.step_inputs import StepInputBuffers

    return [
        ("schedule", Scheduler, "schedule"),
        ("update", Scheduler, "update_from_output"),
        ("execute", ModelRunner, "execute_model"),
        ("batch_apply", InputBatch, "apply"),
        ("prepare_inputs", StepInputBuffers, "prepare"),
        ("sampling_metadata", ModelRunner, "_sampling_metadata"),
        ("forward", ModelRunner, "_forward"),
        ("linears", LinearBase, "matmul"),
        ("attention", PagedAttentionKernel, "attend"),
        ("kv_write", PagedAttentionKernel, "write_kv"),
        ("sample", ModelRunner, "_sample"),
    ]


class PhaseTimes:
    """Seconds and calls per phase, filled while `timing()` is active."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    @contextlib.contextmanager
    def timing(self) -> Iterator[PhaseTimes]:
        originals = []
        try:
            for name, owner, attribute in _phases():
                original = owner.__dict__[attribute]
                originals.append((owner, attribute, original))
                setattr(owner, attribute, self._wrap(name, original))
            yield self
        finally:
            for owner, attribute, original in reversed(originals):
                setattr(owner, attribute, original)

    def _wrap(self, name: str, function):
        self.seconds.setdefault(name, 0.0)
        self.calls.setdefault(name, 0)

        @functools.wraps(function)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1

        return timed

    def report(self, wall_seconds: float) -> dict[str, dict[str, float]]:
        """Per phase: seconds, share of the run's wall time, calls; and what the nesting leaves:
        the runner's own work (`execute` less `forward` and `sample`), the forward's other ops
        (`forward` less `linears`, `attention` and `kv_write`), and the engine's own work (the
        wall time less `execute`: scheduling, output processing, the offline API's loop)."""
        s = self.seconds
        derived = {
            "runner_other": s["execute"] - s["forward"] - s["sample"],
            "forward_other": s["forward"] - s["linears"] - s["attention"] - s["kv_write"],
            "engine_other": wall_seconds - s["execute"],
        }
        rows = {}
        for name, seconds in [*s.items(), *derived.items()]:
            rows[name] = {
                "seconds": round(seconds, 4),
                "share": round(seconds / wall_seconds, 4) if wall_seconds else 0.0,
                "calls": self.calls.get(name, 0),
            }
        return rows


def format_report(rows: dict[str, dict[str, float]]) -> str:
    lines = [f"{'phase':18} {'seconds':>9} {'share':>7} {'calls':>7}"]
    for name, row in rows.items():
        calls = row["calls"] or ""
        lines.append(f"{name:18} {row['seconds']:9.3f} {row['share']:7.1%} {calls:>7}")
    return "\n".join(lines)
