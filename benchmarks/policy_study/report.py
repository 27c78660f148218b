"""The policy study's report: markdown tables, one generated sentence per result, PNG plots.

Runs in the policy study's process, from a results dict (the study's results.json), so a report
can be rewritten from a saved run (``python -m benchmarks policy-study --report-only``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The offline workloads the study times every policy on (bench/offline.py has more: the
# prompt-heavy `long` one needs a longer context than the study's models are given).
STUDY_WORKLOADS = ("equal", "mix")


# --- tables and sentences ------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += [
        "| " + " | ".join(fmt(v) if not isinstance(v, str) else v for v in row) + " |"
        for row in rows
    ]
    return "\n".join(lines)


def offline_section(rows: list[dict[str, Any]], policies: list[str]) -> list[str]:
    by = {(r["policy"], r["workload"]): r for r in rows}
    base = "static" if "static" in policies else policies[0]
    workloads = list(STUDY_WORKLOADS)
    header = ["policy", *(f"{w} output tok/s" for w in workloads)]
    header += [f"{w} vs {base}" for w in workloads] + ["other load (max)"]
    body = []
    for policy in policies:
        tok_s = [by[(policy, w)]["output_tok_s"] for w in workloads]
        vs = [ratio(t, by[(base, w)]["output_tok_s"]) for t, w in zip(tok_s, workloads)]
        load = max(by[(policy, w)]["other_load"] for w in workloads)
        body.append([policy, *tok_s, *(f"{v:.2f}x" for v in vs), f"{load:.2f}"])
    sentences = []
    for w in workloads:
        base_tok_s = by[(base, w)]["output_tok_s"]
        others = [p for p in policies if p != base] or [base]
        top = max(others, key=lambda p: by[(p, w)]["output_tok_s"])
        gain = ratio(by[(top, w)]["output_tok_s"], base_tok_s) or 0.0
        verb = "beats" if gain >= 1.0 else "trails"
        sentences.append(
            f"On `{w}`, the best of the others, {top}, {verb} {base} with "
            f"{by[(top, w)]['output_tok_s']:.0f} vs {base_tok_s:.0f} output tok/s ({gain:.2f}x)."
        )
    return [table(header, body), "", *("- " + s for s in sentences)]


def online_section(online: dict[str, Any], policies: list[str]) -> list[str]:
    header = ["policy", "rate (req/s)", "completed", "failed", "median TTFT (ms)"]
    header += ["p99 TTFT (ms)", "median TBT (ms)", "p99 TBT (ms)", "output tok/s"]
    keys = ("completed", "failed", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms")
    keys += ("p99_itl_ms", "output_throughput")
    body = [[r["policy"], r["request_rate"], *(r[k] for k in keys)] for r in online["sweep"]]
    return [table(header, body), "", *("- " + s for s in online_sentences(online["sweep"]))]


def online_sentences(sweep: list[dict[str, Any]]) -> list[str]:
    top = max(r["request_rate"] for r in sweep)
    at_top = {r["policy"]: r for r in sweep if r["request_rate"] == top}
    fast = min(at_top, key=lambda p: at_top[p]["median_ttft_ms"])
    slow = max(at_top, key=lambda p: at_top[p]["median_ttft_ms"])
    sentences = [
        f"At the highest rate ({top:g} req/s) median TTFT is lowest with {fast} "
        f"({at_top[fast]['median_ttft_ms']:.0f} ms) and highest with {slow} "
        f"({at_top[slow]['median_ttft_ms']:.0f} ms)."
    ]
    if "stall-free" in at_top and "prefill-first" in at_top:
        sf, pf = at_top["stall-free"]["p99_itl_ms"], at_top["prefill-first"]["p99_itl_ms"]
        if max(sf, pf) <= 1.1 * min(sf, pf):
            comparison = "about the same as"
        elif min(sf, pf) == 0.0:
            # No gap between tokens (every token of a choice arrived in one read): no ratio.
            comparison = "lower than" if sf < pf else "higher than"
        else:
            comparison = f"{pf / sf:.1f}x lower than" if sf < pf else f"{sf / pf:.1f}x higher than"
        spread = {
            p: [r["p99_itl_ms"] for r in sweep if r["policy"] == p]
            for p in ("stall-free", "prefill-first")
        }
        sentences.append(
            f"Stall-free's p99 TBT at {top:g} req/s is {comparison} prefill-first's "
            f"({sf:.0f} vs {pf:.0f} ms); over the rates it spans {min(spread['stall-free']):.0f}"
            f"-{max(spread['stall-free']):.0f} ms, prefill-first's "
            f"{min(spread['prefill-first']):.0f}-{max(spread['prefill-first']):.0f} ms."
        )
    return sentences


def capacity_text(row: dict[str, Any]) -> str:
    if row["capacity"] is None:
        return "none held"
    return ("≥ " if row["lower_bound"] else "") + f"{row['capacity']:.2f}"


def capacity_section(online: dict[str, Any]) -> list[str]:
    header = [
        "policy",
        "token budget",
        "capacity (req/s)",
        "mean E2E at capacity (s)",
        "probes",
        "p99 TBT / median TTFT per probe (ms @ req/s)",
    ]
    lines = [f"SLO: {slo_text(online)}, no failed request.", ""]
    body = [_capacity_row(r, r["policy"]) for r in online["capacity"]]
    lines += [table(header, body), ""]
    lines.append("- " + capacity_sentence(online["capacity"]))
    if sentence := queueing_sentence(online["capacity"], online.get("slo_ttft_median_ms")):
        lines.append("- " + sentence)
    if online["budgets"]:
        lines += ["", "Stall-free by token budget (`--max-num-batched-tokens`):", ""]
        body = [_capacity_row(r, "stall-free") for r in online["budgets"]]
        lines += [table(header, body), ""]
        lines.append("- " + budget_sentence(online["budgets"]))
    return lines


def slo_bounds(online: dict[str, Any]) -> str:
    # .get: results.json files written before the TTFT bound existed have no such key.
    ttft = online.get("slo_ttft_median_ms")
    bound = "" if ttft is None else f", median TTFT ≤ {ttft:g} ms"
    return f"p99 TBT ≤ {online['slo_tbt_p99_ms']:g} ms{bound}"


def slo_text(online: dict[str, Any]) -> str:
    text = slo_bounds(online)
    calibration = online.get("slo_calibration") or {}
    if calibration.get("calibrated"):
        text += (
            f" (the TBT bound is {calibration['factor']:g}x the {calibration['budget_step_ms']:g}"
            f" ms a full {calibration['token_budget']}-token stall-free step took here)"
        )
    return text


def capacity_sentence(rows: list[dict[str, Any]]) -> str:
    held = [r for r in rows if r["capacity"] is not None]
    if not held:
        return "No policy held the SLO at any probed rate: raise the SLO or lower the rates."
    top = max(held, key=lambda r: r["capacity"])
    best = [r["policy"] for r in held if r["capacity"] == top["capacity"]]
    lead = f"{best[0]} sustains" if len(best) == 1 else f"{' and '.join(best)} tie for"
    rest = ", ".join(f"{r['policy']} {capacity_text(r)}" for r in rows if r["policy"] not in best)
    text = f"{lead} the most load under the SLO: {capacity_text(top)} req/s"
    if rest:
        ratios = [
            f"{top['capacity'] / r['capacity']:.1f}x {r['policy']}'s"
            for r in rows
            if r["policy"] not in best and r["capacity"]
        ]
        text += f" ({', '.join(ratios)})" if ratios else ""
        text += f"; {rest}"
    return text + "."


def _capacity_row(row: dict[str, Any], name: str) -> list[Any]:
    probes = ", ".join(
        f"{p['p99_itl_ms']:.0f} / {_ms_text(p.get('median_ttft_ms'))} @ {p['request_rate']:.2f}"
        for p in row["probes"]
    )
    e2el = _e2el_at_capacity(row)
    e2el_text = "n/a" if e2el is None else f"{e2el / 1000:.1f}"
    return [name, row["token_budget"], capacity_text(row), e2el_text, row["num_probes"], probes]


def _ms_text(value: float | None) -> str:
    # Probes recorded before the TTFT bound existed have no median TTFT.
    return "n/a" if value is None else f"{value:.0f}"


def _e2el_at_capacity(row: dict[str, Any]) -> float | None:
    """Mean end-to-end latency (ms) of the probe at the capacity rate."""
    return next(
        (p["mean_e2el_ms"] for p in row["probes"] if p["request_rate"] == row["capacity"]), None
    )


def queueing_sentence(rows: list[dict[str, Any]], ttft_bound_ms: float | None) -> str | None:
    """How long requests took at each policy's capacity: without the median TTFT bound the TBT
    SLO does not bound queueing, so this says which policy held it only by making requests
    wait; with it, how far apart the policies still are within the bound."""
    measured = [(r, _e2el_at_capacity(r)) for r in rows if _e2el_at_capacity(r) is not None]
    if len(measured) < 2:
        return None
    worst, worst_ms = max(measured, key=lambda m: m[1])
    best, best_ms = min(measured, key=lambda m: m[1])
    if ttft_bound_ms is None:
        lead = "The TBT SLO does not bound queueing"
    else:
        lead = f"With queueing bounded (median TTFT ≤ {ttft_bound_ms:g} ms)"
    return (
        f"{lead}: at its capacity rate {worst['policy']}'s mean "
        f"end-to-end latency is {worst_ms / 1000:.1f} s against {best_ms / 1000:.1f} s for "
        f"{best['policy']} at its own capacity rate."
    )


def budget_sentence(rows: list[dict[str, Any]]) -> str:
    held = [r for r in rows if r["capacity"] is not None]
    if not held:
        return "No token budget held the SLO at any probed rate."
    best = max(held, key=lambda r: r["capacity"])
    worst = min(rows, key=lambda r: r["capacity"] or 0.0)
    return (
        f"The budget of {best['token_budget']} tokens gives the highest capacity "
        f"({capacity_text(best)} req/s), {worst['token_budget']} the lowest "
        f"({capacity_text(worst)}): small budgets cut each step's time (and TBT) but spend more "
        "steps per prompt, large ones the reverse."
    )


# --- plots ---------------------------------------------------------------------------------------


def plot_offline(rows: list[dict[str, Any]], policies: list[str], path: Path) -> None:
    import matplotlib.pyplot as plt

    workloads = list(STUDY_WORKLOADS)
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(policies)
    for i, policy in enumerate(policies):
        values = [
            next(r["output_tok_s"] for r in rows if r["policy"] == policy and r["workload"] == w)
            for w in workloads
        ]
        ax.bar([x + i * width for x in range(len(workloads))], values, width, label=policy)
    ax.set_xticks([x + width * (len(policies) - 1) / 2 for x in range(len(workloads))], workloads)
    ax.set_ylabel("output tokens/s")
    ax.set_title("offline throughput")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_online(sweep: list[dict[str, Any]], policies: list[str], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key, ax, title in (
        ("median_ttft_ms", axes[0], "median TTFT"),
        ("p99_itl_ms", axes[1], "p99 TBT (inter-token latency)"),
    ):
        for policy in policies:
            rows = [r for r in sweep if r["policy"] == policy]
            ax.plot([r["request_rate"] for r in rows], [r[key] for r in rows], "o-", label=policy)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_capacity(online: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, rows, name, title in (
        (axes[0], online["capacity"], "policy", "capacity per policy"),
        (axes[1], online["budgets"], "token_budget", "stall-free capacity per token budget"),
    ):
        labels = [str(r[name]) for r in rows]
        ax.bar(labels, [r["capacity"] or 0.0 for r in rows])
        ax.set_ylabel("req/s under the SLO")
        ax.set_title(title)
    fig.suptitle(f"SLO: {slo_bounds(online)}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- the report file -----------------------------------------------------------------------------


def write_report(out: Path, results: dict[str, Any]) -> Path:
    policies = results["policies"]
    online = results["online"]
    plot_offline(results["offline"], policies, out / "offline_throughput.png")
    plot_online(online["sweep"], policies, out / "online_latency.png")
    plot_capacity(online, out / "capacity.png")
    config = results["config"]
    lines = [
        "# Scheduling policy study",
        "",
        f"Command: `{results['command']}` ({results['seconds'] / 60:.1f} min, {results['date']}).",
        "",
        f"Model: `{results['model']}`; stall-free token budget {config['token_budget']}, the "
        f"whole-prompt policies {max(config['token_budget'], config['max_model_len'])} "
        f"(max_model_len {config['max_model_len']}).",
        "",
        "Every process here shares the same cores (engine, workers, frontend and the load "
        "generator), and the machine may be shared with other jobs (the offline table shows "
        "their share of the cores per run; 1/5/15-min load average at the end: "
        f"{', '.join(f'{v:.1f}' for v in results['load_average_at_end'])}), so the numbers are "
        "noisy: compare ratios measured in one run, not absolute values across runs.",
        "",
        "## 1. Offline throughput",
        "",
        f"{config['offline_num_requests']} requests per workload (`conveyor bench offline`'s `equal`: "
        "128 in / 128 out; `mix`: alternating 32/32 and 512/128), max_num_seqs "
        f"{config['offline_max_num_seqs']}, greedy, ignore_eos.",
        "",
        *offline_section(results["offline"], policies),
        "",
        "![offline throughput](offline_throughput.png)",
        "",
        "## 2. Online latency at rising request rates",
        "",
        f"sharegpt-like requests (lognormal lengths: input mean {config['sharegpt_input_mean']:g}, "
        f"output mean {config['sharegpt_output_mean']:g}, at most {config['sharegpt_max_len']}), "
        f"{config['online_num_prompts']} per rate, Poisson arrivals, max_num_seqs "
        f"{config['online_max_num_seqs']}.",
        "",
        *online_section(online, policies),
        "",
        "![online latency](online_latency.png)",
        "",
        "## 3. Serving capacity under latency SLOs",
        "",
        "Bracketing, then bisection over request rates (loadgen `--capacity-search`); each probe "
        f"sends for {config['capacity_probe_s']:g} s (rate x that many requests; at least "
        f"{config.get('capacity_min_requests', 0)}, past the {config['capacity_probe_s']:g} s "
        "at low rates), at most "
        f"{config['capacity_max_probes']} probes per search, rates up to "
        f"{config['capacity_max_rate']:g} req/s.",
        "",
        *capacity_section(online),
        "",
        "![capacity](capacity.png)",
        "",
        "## Machine and config",
        "",
        "```json",
        json.dumps({"machine": results["machine"], "config": config}, indent=2),
        "```",
        "",
        "The load generator commands (each run in-process, equivalent to these) are in "
        "results.json under `loadgen_commands`.",
    ]
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    return report
