"""The adaptive-budget study's report, from made-up results (no server: seconds)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from benchmarks.policy_study.adaptive import PRESETS_ADAPTIVE, setup_args
from benchmarks.policy_study.adaptive_report import write_adaptive_report
from benchmarks.policy_study.server import engine_flags
from conveyor.frontend.engine_args import EngineArgs, _parse_bytes


def found(capacity: float, lower_bound: bool = False) -> dict:
    probe = {"request_rate": capacity, "holds": True, "p99_itl_ms": 90.0, "median_ttft_ms": 300.0}
    return {
        "capacity_request_rate": capacity,
        "capacity_is_lower_bound": lower_bound,
        "capacity_probes": [probe, {**probe, "request_rate": 2 * capacity, "holds": False}],
        "other_load": [0.1, 0.4],
        "busy_retries": 1,
    }


def model(size: str, caps: dict[str, float], out: Path) -> dict:
    trace = f"adaptive_trace_{size}.jsonl"
    records = []
    for i in range(40):
        records.append({"time": 0.1 * i, "duration_ms": 80.0 + i % 7, "predicted_ms": 82.0,
                        "num_prefill_tokens": 200, "num_decode_tokens": 8, "token_budget": 210,
                        "over_slo": "min-chunk" if i == 5 else None, "profile": i < 3})  # fmt: skip
    (out / trace).write_text("".join(json.dumps(r) + "\n" for r in records))
    sweep = [{"fraction": f, "request_rate": f * caps["adaptive"], "completed": 20, "failed": 0,
              "p99_itl_ms": 100.0 * f, "median_ttft_ms": 200.0, "other_load": 0.1}
             for f in (0.5, 1.0)]  # fmt: skip
    phases = [{**sweep[0], "start_s": 0.0}, {**sweep[1], "start_s": 2.0}]
    return {
        "size": size,
        "capacities": {label: found(cap) for label, cap in caps.items()},
        "tbt_sweep": sweep,
        "load_phases": phases,
        "trace": trace,
    }


def test_the_report_compares_adaptive_with_every_fixed_budget_on_every_model(tmp_path):
    config = PRESETS_ADAPTIVE["smoke"]
    results = {
        "command": "python -m benchmarks policy-study --adaptive",
        "date": "2026-01-01 00:00",
        "seconds": 60.0,
        "machine": {"num_cpus": 2},
        "config": dataclasses.asdict(config),
        "slo": {"slo_tbt_p99_ms": 120.0, "calibrated": False},
        "models": [
            model("bench", {"128": 8.0, "256": 6.0, "2048": 3.0, "adaptive": 7.5}, tmp_path),
            model("small", {"128": 10.0, "256": 14.0, "2048": 20.0, "adaptive": 19.0}, tmp_path),
        ],
    }
    report = write_adaptive_report(tmp_path, results).read_text()
    rows = {line.split("|")[1].strip(): line for line in report.splitlines() if "| fixed" in line}
    assert set(rows) == {"fixed 128", "fixed 256", "fixed 2048"}
    assert "| adaptive | 7.50 | 0.94x | 19.00 | 0.95x | 0.94x |" in report
    assert "No single fixed budget is within 0.9x of the best on every model." in report
    assert "adaptive reaches 7.50 req/s, 0.94x of it (meets the 0.9x goal)" in report
    assert "stays under the 120 ms SLO at every rate up to capacity" in report
    assert "1 of them holding a minimum chunk" in report
    for plot in ("adaptive_capacity.png", "adaptive_trace_bench.png", "adaptive_trace_small.png"):
        assert f"({plot})" in report and (tmp_path / plot).stat().st_size > 1000


def test_adaptive_servers_get_the_slo_and_fixed_ones_a_budget(tiny_model_dir):
    config = PRESETS_ADAPTIVE["smoke"]
    adaptive = engine_flags(setup_args(config, str(tiny_model_dir), "adaptive", 50.0))
    assert adaptive[adaptive.index("--tbt-slo-ms") + 1] == "50"
    assert adaptive[adaptive.index("--max-num-batched-tokens") + 1] == str(config.adaptive_cap)
    fixed = engine_flags(setup_args(config, str(tiny_model_dir), "64", 50.0))
    assert "--tbt-slo-ms" not in fixed
    assert fixed[fixed.index("--max-num-batched-tokens") + 1] == "64"
    # The study's KV budget reaches the server; an unset one is left to the server's default.
    expected = str(_parse_bytes(config.study.kv_cache_memory))
    assert fixed[fixed.index("--kv-cache-memory") + 1] == expected
    assert "--kv-cache-memory" not in engine_flags(EngineArgs(model=str(tiny_model_dir)))
