"""python -m benchmarks policy-study end to end in its --smoke mode: the tiny model, a few requests.

Runs the study as a child process (it starts its own engines and servers) and reads what it
wrote: the report, its plots, and a numeric table row per policy in every section. About 40 s
on an idle 2-core machine (five engine starts), hence slow.
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
import subprocess
from pathlib import Path

import pytest

from tests.commands import LAB

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ("static", "orca", "prefill-first", "stall-free")
PLOTS = ("offline_throughput.png", "online_latency.png", "capacity.png")
NUMBER = re.compile(r"^(≥ )?-?\d+(\.\d+)?x?$")


def section_tables(report: str) -> dict[str, list[list[str]]]:
    """Section title -> the data rows (cells) of the tables in it."""
    tables: dict[str, list[list[str]]] = {}
    title = ""
    for line in report.splitlines():
        if line.startswith("## "):
            title = line[3:]
        elif line.startswith("| ") and not line.startswith("| policy |"):
            tables.setdefault(title, []).append([c.strip() for c in line.strip("|").split("|")])
    return tables


@pytest.fixture(scope="module")
def smoke_study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("policy_study")
    command = [*LAB, "policy-study", "--smoke"]
    done = subprocess.run(
        [*command, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return out


@pytest.mark.slow
@pytest.mark.xdist_group("policy-study")  # one worker runs the study, both tests read it
def test_the_smoke_study_writes_a_report_and_its_plots(smoke_study: Path):
    report = (smoke_study / "report.md").read_text()
    for plot in PLOTS:
        assert (smoke_study / plot).stat().st_size > 1000, plot
        assert f"({plot})" in report, f"the report does not link {plot}"
    assert "python -m benchmarks policy-study --smoke" in report
    assert '"num_cpus"' in report, "machine info"


@pytest.mark.slow
@pytest.mark.xdist_group("policy-study")
def test_every_section_has_a_numeric_row_per_policy(smoke_study: Path):
    tables = section_tables((smoke_study / "report.md").read_text())
    assert len(tables) == 3, list(tables)
    for title, rows in tables.items():
        for policy in POLICIES:
            row = next((r for r in rows if r[0] == policy), None)
            assert row is not None, f"{title}: no row for {policy}"
            numeric = [c for c in row[1:] if NUMBER.match(c)]
            assert len(numeric) >= 2, f"{title}: {row}"


def test_the_tbt_slo_is_calibrated_from_full_budget_steps(tmp_path: Path):
    # Without a fixed SLO the study measures stall-free steps that fill the token budget on
    # this machine and sets the SLO to a multiple of their median, so the experiment means the
    # same on a slow and a fast machine.
    from benchmarks.policy_study import study as policy_study

    config = dataclasses.replace(policy_study.PRESETS["smoke"], slo_tbt_p99_ms=None)
    model = policy_study.resolve_model(config, None)
    slo = policy_study.calibrate_slo(config, model, tmp_path)
    steps = [json.loads(line) for line in (tmp_path / "calibration_trace.jsonl").open()]
    full = sorted(
        s["duration_ms"]
        for s in steps[-6:]
        if s["num_prefill_tokens"] == config.token_budget and s["num_decode_tokens"] == 0
    )
    assert len(full) == 6, steps[-6:]
    assert slo["calibrated"] and slo["budget_step_ms"] == round(statistics.median(full), 1)
    assert slo["slo_tbt_p99_ms"] == round(
        config.slo_budget_step_factor * statistics.median(full), 1
    )
    fixed = dataclasses.replace(config, slo_tbt_p99_ms=75.0)
    assert policy_study.calibrate_slo(fixed, model, tmp_path) == {
        "slo_tbt_p99_ms": 75.0,
        "calibrated": False,
    }


def test_a_sweep_with_no_gap_between_tokens_still_reads():
    """Every token of a choice may arrive in one read (short outputs, a busy machine): a p99 TBT
    of 0 must give a sentence, not a division by zero."""
    from benchmarks.policy_study import report as policy_study_report

    def row(policy: str, p99_itl_ms: float) -> dict:
        return {"policy": policy, "request_rate": 8.0, "median_ttft_ms": 50.0,
                "p99_itl_ms": p99_itl_ms}  # fmt: skip

    sentences = policy_study_report.online_sentences(
        [row("stall-free", 12.0), row("prefill-first", 0.0)]
    )
    assert "Stall-free's p99 TBT at 8 req/s is higher than prefill-first's" in sentences[1]
    sentences = policy_study_report.online_sentences(
        [row("stall-free", 0.0), row("prefill-first", 0.0)]
    )
    assert "about the same as" in sentences[1]
