"""The adaptive-budget study's report: tables, generated sentences and PNG plots.

Runs in the policy study's process, from the results dict (adaptive.json), so a report can be
rewritten from a saved run (``python -m benchmarks policy-study --adaptive --report-only``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.policy_study.report import fmt, table

ADAPTIVE = "adaptive"
# adaptive must reach this share of the best fixed budget's capacity on every model.
TARGET_RATIO = 0.9


def capacities(model: dict[str, Any]) -> dict[str, float]:
    """Setup label -> capacity (req/s, 0 when no probe held)."""
    return {
        label: found["capacity_request_rate"] or 0.0 for label, found in model["capacities"].items()
    }


def ratios(model: dict[str, Any]) -> dict[str, float | None]:
    """Setup label -> its capacity / the best fixed budget's (None when none held)."""
    caps = capacities(model)
    best = max(cap for label, cap in caps.items() if label != ADAPTIVE)
    return {label: (cap / best if best else None) for label, cap in caps.items()}


def capacity_section(results: dict[str, Any]) -> list[str]:
    models = results["models"]
    labels = list(models[0]["capacities"])
    header = ["setup"]
    for model in models:
        header += [f"{model['size']} capacity (req/s)", f"{model['size']} vs best fixed"]
    header.append("worst ratio")
    rows = []
    for label in labels:
        row: list[Any] = [label if label == ADAPTIVE else f"fixed {label}"]
        worst = None
        for model in models:
            found = model["capacities"][label]
            bound = "≥ " if found["capacity_is_lower_bound"] else ""
            ratio = ratios(model)[label]
            row += [f"{bound}{capacities(model)[label]:.2f}", _ratio_text(ratio)]
            worst = ratio if worst is None or (ratio is not None and ratio < worst) else worst
        row.append(_ratio_text(worst))
        rows.append(row)
    return [table(header, rows), "", *("- " + s for s in capacity_sentences(models))]


def _ratio_text(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def capacity_sentences(models: list[dict[str, Any]]) -> list[str]:
    sentences = []
    for model in models:
        caps, rel = capacities(model), ratios(model)
        fixed = {label: cap for label, cap in caps.items() if label != ADAPTIVE}
        best = max(fixed, key=lambda label: fixed[label])
        verdict = "meets" if (rel[ADAPTIVE] or 0.0) >= TARGET_RATIO else "misses"
        sentences.append(
            f"On `{model['size']}` the best fixed budget is {best} tokens ({fixed[best]:.2f} "
            f"req/s); adaptive reaches {caps[ADAPTIVE]:.2f} req/s, "
            f"{_ratio_text(rel[ADAPTIVE])} of it ({verdict} the {TARGET_RATIO:g}x goal)."
        )
    if len(models) > 1:
        labels = [label for label in models[0]["capacities"] if label != ADAPTIVE]
        both = [
            label
            for label in labels
            if all((ratios(m)[label] or 0.0) >= TARGET_RATIO for m in models)
        ]
        if both:
            sentences.append(
                f"Fixed budgets within {TARGET_RATIO:g}x of the best on every model too: "
                f"{', '.join(both)}."
            )
        else:
            sentences.append(
                f"No single fixed budget is within {TARGET_RATIO:g}x of the best on every model."
            )
    return sentences


def probes_section(results: dict[str, Any]) -> list[str]:
    header = ["model", "setup", "p99 TBT / median TTFT per probe (ms @ req/s; ✗ broke)"]
    header += ["other load (mean, max)", "probes rerun"]
    rows = []
    for model in results["models"]:
        for label, found in model["capacities"].items():
            probes = ", ".join(
                f"{p['p99_itl_ms']:.0f} / {p['median_ttft_ms']:.0f} @ {p['request_rate']:.2f}"
                + ("" if p["holds"] else " ✗")
                for p in found["capacity_probes"]
            )
            loads = found.get("other_load") or [0.0]
            load = f"{sum(loads) / len(loads):.2f}, {max(loads):.2f}"
            rows.append([model["size"], label, probes, load, found.get("busy_retries", 0)])
    return [
        table(header, rows),
        "",
        f"A probe that broke while other processes kept more than "
        f"{results['config']['busy_load']:g} of the cores busy ran again (at most "
        f"{results['config']['busy_retries']} times); the table shows the last run of each.",
    ]


def tbt_section(results: dict[str, Any]) -> list[str]:
    slo = results["slo"]["slo_tbt_p99_ms"]
    header = ["model", "rate (req/s)", "of capacity", "completed", "failed", "p99 TBT (ms)"]
    header += ["median TTFT (ms)", "other load"]
    rows, sentences = [], []
    for model in results["models"]:
        for r in model["tbt_sweep"]:
            rows.append([model["size"], f"{r['request_rate']:.2f}", f"{r['fraction']:.2f}",
                         r["completed"], r["failed"], r["p99_itl_ms"], r["median_ttft_ms"],
                         f"{r['other_load']:.2f}"])  # fmt: skip
        worst = max(model["tbt_sweep"], key=lambda r: r["p99_itl_ms"])
        held = all(r["p99_itl_ms"] <= slo for r in model["tbt_sweep"])
        sentences.append(
            f"`{model['size']}`: p99 TBT {'stays under' if held else 'does not stay under'} "
            f"the {slo:g} ms SLO at every rate up to capacity; the highest is "
            f"{worst['p99_itl_ms']:.0f} ms at {worst['request_rate']:.2f} req/s."
        )
    return [table(header, rows), "", *("- " + s for s in sentences)]


def read_trace_records(out: Path, model: dict[str, Any]) -> list[dict[str, Any]]:
    path = out / model["trace"]
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# Why a phase of the changing-load run can read over the SLO though the per-rate runs do not.
TRACE_NOTE = (
    "Each phase lasts a few seconds, so its p99 TBT (measured by the client) rests on few "
    "gaps. The first phase starts right after the start-up profile, when the noise allowance "
    "(the 99th percentile of measured / predicted over recent steps predicted at half the SLO"
    " or more) rests on the start-up profile's last few steps only, so the first steps "
    "sized near the SLO carry little margin. A phase past the capacity found above breaks the SLO on purpose."
)


def trace_section(out: Path, results: dict[str, Any]) -> list[str]:
    slo = results["slo"]["slo_tbt_p99_ms"]
    lines: list[str] = []
    for model in results["models"]:
        records = [r for r in read_trace_records(out, model) if not r["profile"]]
        timed = [r for r in records if r["predicted_ms"] is not None and r["duration_ms"] > 0]
        if not timed:
            continue
        error = sum(abs(r["predicted_ms"] - r["duration_ms"]) for r in timed) / sum(
            r["duration_ms"] for r in timed
        )
        decoding = [r for r in timed if r["num_decode_tokens"]]
        over = sum(r["duration_ms"] > slo for r in decoding)
        forced = sum(r["over_slo"] == "min-chunk" for r in decoding)
        plot = f"adaptive_trace_{model['size']}.png"
        plot_trace(records, model["load_phases"], slo, out / plot, model["size"])
        header = ["phase rate (req/s)", "completed", "p99 TBT (ms)", "median TTFT (ms)"]
        rows = [[f"{p['request_rate']:.2f}", p["completed"], p["p99_itl_ms"],
                 p["median_ttft_ms"]] for p in model["load_phases"]]  # fmt: skip
        lines += [
            f"`{model['size']}`: {len(records)} steps; the model's error (sum of |measured - "
            f"predicted| / sum of measured) {100 * error:.1f} %; of {len(decoding)} steps with "
            f"decodes {over} took longer than the SLO ({100 * over / max(len(decoding), 1):.1f} "
            f"%), {forced} of them holding a minimum chunk the SLO had no room for.",
            "",
            table(header, rows),
            "",
            f"![chosen budget and step time, {model['size']}]({plot})",
            "",
        ]
    return lines


def plot_capacity(results: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    models = results["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        caps = capacities(model)
        colors = ["tab:orange" if label == ADAPTIVE else "tab:blue" for label in caps]
        ax.bar(list(caps), list(caps.values()), color=colors)
        ax.set_title(f"{model['size']}: capacity per token budget")
        ax.set_ylabel("req/s under the SLO")
        ax.set_xlabel("fixed token budget, or adaptive")
    fig.suptitle(f"SLO: p99 TBT ≤ {results['slo']['slo_tbt_p99_ms']:g} ms, median TTFT ≤ 2 s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_trace(
    records: list[dict[str, Any]],
    phases: list[dict[str, Any]],
    slo_ms: float,
    path: Path,
    size: str,
) -> None:
    """Chosen budget and scheduled tokens above, measured and predicted step time below."""
    import matplotlib.pyplot as plt

    t0 = records[0]["time"] - records[0]["duration_ms"] / 1e3
    times = [r["time"] - t0 for r in records]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    top.plot(times, [r["token_budget"] for r in records], "-", lw=1, label="token budget chosen")
    top.plot(times, [r["num_prefill_tokens"] + r["num_decode_tokens"] for r in records], ".",
             ms=3, label="tokens scheduled")  # fmt: skip
    top.set_ylabel("tokens per step")
    top.set_yscale("log")
    bottom.plot(times, [r["duration_ms"] for r in records], ".", ms=3, color="tab:red",
                label="measured")  # fmt: skip
    bottom.plot(times, [r["predicted_ms"] for r in records], "-", lw=0.8, color="tab:gray",
                label="predicted")  # fmt: skip
    bottom.axhline(slo_ms, color="black", ls="--", lw=1, label=f"TBT SLO {slo_ms:g} ms")
    bottom.set_ylabel("step time (ms)")
    bottom.set_xlabel("seconds")
    bottom.set_ylim(0, 2.5 * slo_ms)
    ends = [p["start_s"] for p in phases[1:]] + [times[-1]]
    for i, (phase, end) in enumerate(zip(phases, ends)):
        for ax in (top, bottom):
            ax.axvspan(phase["start_s"], end, color="0.9" if i % 2 else "0.97", zorder=0)
        top.text(phase["start_s"], 1.02, f"{phase['request_rate']:.1f} req/s",
                 transform=top.get_xaxis_transform(), fontsize=8)  # fmt: skip
    top.legend(loc="lower right", fontsize=8)
    bottom.legend(loc="upper right", fontsize=8)
    top.set_title(f"{size}: adaptive token budget under changing load", pad=16)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _rate_caps(results: dict[str, Any]) -> str:
    config = results["config"]
    return ", ".join(
        f"{m.get('capacity_start_rate', config['capacity_start_rate']):g} up to "
        f"{m.get('capacity_max_rate', config['capacity_max_rate']):g} (`{m['size']}`)"
        for m in results["models"]
    )


def write_adaptive_report(out: Path, results: dict[str, Any]) -> Path:
    plot_capacity(results, out / "adaptive_capacity.png")
    slo = results["slo"]
    study = results["config"]["study"]
    slo_text = f"p99 TBT ≤ {slo['slo_tbt_p99_ms']:g} ms"
    if slo.get("calibrated"):
        slo_text += (
            f" ({slo['factor']:g}x the {slo['budget_step_ms']:g} ms a full "
            f"{slo['token_budget']}-token step of `{results['models'][0]['size']}` took here)"
        )
    lines = [
        "# SLO-aware token budget: adaptive against fixed budgets",
        "",
        f"Command: `{results['command']}` ({results['seconds'] / 60:.1f} min, "
        f"{results['date']}). The machine is shared: the probe table below gives the share of "
        "the cores other processes kept busy during each setup's probes.",
        "",
        f"SLO: {slo_text}, median TTFT ≤ {fmt(study['slo_ttft_median_ms'], 0)} ms, no failed "
        f"request; the same on every model. Workload: sharegpt-like (input mean "
        f"{study['sharegpt_input_mean']:g}, output mean {study['sharegpt_output_mean']:g}, at "
        f"most {study['sharegpt_max_len']}), Poisson arrivals, max_num_seqs "
        f"{study['online_max_num_seqs']}, stall-free. `adaptive`: `--tbt-slo-ms "
        f"{slo['slo_tbt_p99_ms']:g}`, hard cap {results['config']['adaptive_cap']} tokens. "
        f"Capacity searches interleaved probe by probe, {study['capacity_probe_s']:g} s probes "
        f"(at least {study['capacity_min_requests']} requests), doubling from "
        f"{_rate_caps(results)} req/s, then bisecting; at most "
        f"{results['config']['capacity_max_probes']} probes per search.",
        "",
        "## Capacity per model and token budget",
        "",
        *capacity_section(results),
        "",
        "![capacity per budget](adaptive_capacity.png)",
        "",
        *probes_section(results),
        "",
        "## adaptive's p99 TBT per rate",
        "",
        *tbt_section(results),
        "",
        "## Chosen budget and step time under changing load",
        "",
        TRACE_NOTE,
        "",
        *trace_section(out, results),
        "## Machine",
        "",
        "```json",
        json.dumps(results["machine"], indent=2),
        "```",
    ]
    report = out / "adaptive.md"
    report.write_text("\n".join(lines) + "\n")
    return report
