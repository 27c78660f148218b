"""Step time as a function of what a step holds, fitted to a real engine's step trace.

Runs in the benchmark's own process. The simulated engines take as long per step as this model
says, so the simulation's times are this machine's. The features are the step-cost model's
(``engine_core/step_cost.py``): a fixed cost per step, prefill tokens, decode tokens, attention
(query, key) pairs and requests. The fit is least squares on relative error (a step's noise grows
with its size), with no negative coefficient: a feature that comes out negative is fixed at 0 and
the rest refitted, so no step is predicted cheaper for holding more.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from conveyor.engine_core.step_trace import StepTraceRecord, read_trace

FEATURES = ("fixed_s", "per_prefill_token_s", "per_decode_token_s", "per_pair_s", "per_req_s")


@dataclass(frozen=True)
class StepCost:
    """Seconds per step, per prefill token, per decode token, per attention pair, per request."""

    fixed_s: float
    per_prefill_token_s: float
    per_decode_token_s: float
    per_pair_s: float
    per_req_s: float

    def __call__(
        self, num_prefill_tokens: int, num_decode_tokens: int, num_pairs: int, num_reqs: int
    ) -> float:
        return (
            self.fixed_s
            + self.per_prefill_token_s * num_prefill_tokens
            + self.per_decode_token_s * num_decode_tokens
            + self.per_pair_s * num_pairs
            + self.per_req_s * num_reqs
        )

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in FEATURES}


# The fit of docs/scaleout_step_trace.jsonl: the bench model, float32, on the 2-core AVX2 machine,
# recorded with `python -m benchmarks scaleout --record-trace FILE --model BENCH --record-sessions 32`
# (2026-11-26). Used when no trace is given; a test checks it is still that file's fit.
BENCH_TRACE = "docs/scaleout_step_trace.jsonl"
BENCH_MODEL_COST = StepCost(
    fixed_s=1.1798e-2,
    per_prefill_token_s=8.5908e-5,
    per_decode_token_s=6.8437e-4,
    per_pair_s=4.0115e-7,
    per_req_s=0.0,
)


def _features(records: list[StepTraceRecord]) -> np.ndarray:
    return np.array(
        [
            [1.0, r.num_prefill_tokens, r.num_decode_tokens, r.num_attention_pairs, r.num_reqs]
            for r in records
        ]
    )


def fit_step_cost(records: list[StepTraceRecord]) -> StepCost:
    """The non-negative relative-error least-squares fit of the records' step times."""
    timed = [r for r in records if r.duration_ms > 0 and not r.profile]
    if len(timed) < len(FEATURES):
        raise ValueError(f"a trace of {len(timed)} timed steps is too short to fit")
    if not any(r.num_attention_pairs for r in timed):
        raise ValueError("the trace has no attention pairs (written before they were recorded)")
    x = _features(timed)
    y = np.array([r.duration_ms / 1e3 for r in timed])
    # Dividing each row by its time weighs every step by its relative error; columns are scaled
    # to unit norm so the solver sees numbers of one size.
    weighted = x / y[:, None]
    scale = np.linalg.norm(weighted, axis=0)
    scale[scale == 0] = 1.0
    free = list(range(len(FEATURES)))
    while True:
        solved, *_ = np.linalg.lstsq(weighted[:, free] / scale[free], np.ones(len(y)), rcond=None)
        solved = solved / scale[free]
        if (solved >= 0).all():
            break
        free.pop(int(np.argmin(solved)))
    coef = np.zeros(len(FEATURES))
    coef[free] = solved
    return StepCost(*(float(c) for c in coef))


def fit_trace_file(path: str | Path) -> tuple[StepCost, float]:
    """The fit of a trace file and its mean relative error over the file's steps."""
    records = [r for r in read_trace(path) if r.duration_ms > 0 and not r.profile]
    cost = fit_step_cost(records)
    errors = [
        abs(
            cost(r.num_prefill_tokens, r.num_decode_tokens, r.num_attention_pairs, r.num_reqs) * 1e3
            - r.duration_ms
        )
        / r.duration_ms
        for r in records
    ]
    return cost, float(np.mean(errors))
