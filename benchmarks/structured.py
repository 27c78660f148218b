"""What a JSON-schema constraint costs: output tokens per second with and without it.

Runs ``LLM`` (engine-core process + worker) on one model, three batches of ``--num-requests``
random-token prompts, interleaved round after round so their ratios come from one machine state:

- ``plain``: no constraint;
- ``json``: every request under a JSON schema (an object holding an array of short strings,
  which a random model never closes, so every request writes exactly ``--output-len`` tokens
  under the grammar, as ``plain`` writes them without);
- ``mixed``: half constrained, half not.

All sample (temperature 1, seeded) with ``ignore_eos``, so every batch produces the same number
of tokens. The engine's step trace gives each step's duration: a running request gets one token
per step, so the p99 step time of ``mixed`` against ``plain`` is what unconstrained requests'
inter-token latency pays for running beside constrained ones. Usage::

    python -m benchmarks structured [--model DIR] [--num-requests 64] [--output-len 64]
        [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from conveyor.bench.machine import machine_info, print_report_start

SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 12}}},
    "required": ["items"],
    "additionalProperties": False,
}
PROMPT_LEN = 32


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.fixtures.model_maker import ensure_model
    from conveyor.frontend import LLM
    from conveyor.protocol import SamplingParams, StructuredOutputsParams

    model = str(args.model or ensure_model("bench", "qwen3"))
    trace_dir = Path(tempfile.mkdtemp(prefix="conveyor-bench-"))
    trace = trace_dir / "steps.jsonl"
    rng = random.Random(0)
    llm = LLM(model, max_num_seqs=max(64, args.num_requests), trace_steps=str(trace))
    vocab_size = llm.config.model.vocab_size

    def prompts() -> list[list[int]]:
        return [
            [rng.randrange(10, vocab_size) for _ in range(PROMPT_LEN)]
            for _ in range(args.num_requests)
        ]

    def params(constrained: bool, seed: int) -> SamplingParams:
        spec = StructuredOutputsParams(json=SCHEMA) if constrained else None
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=args.output_len,
                              ignore_eos=True, structured_outputs=spec)  # fmt: skip

    half = args.num_requests // 2
    batches = {
        "plain": [params(False, i) for i in range(args.num_requests)],
        "json": [params(True, i) for i in range(args.num_requests)],
        "mixed": [params(i >= half, i) for i in range(args.num_requests)],
    }
    rates: dict[str, list[float]] = {name: [] for name in batches}
    steps: dict[str, list[float]] = {name: [] for name in batches}
    try:
        llm.generate(prompts(), batches["json"], use_tqdm=False)  # warm-up: first grammar use
        for _ in range(args.rounds):
            for name, batch in batches.items():
                num_lines = len(trace.read_text().splitlines()) if trace.exists() else 0
                start = time.perf_counter()
                outputs = llm.generate(prompts(), batch, use_tqdm=False)
                elapsed = time.perf_counter() - start
                num_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
                assert num_tokens == args.num_requests * args.output_len, num_tokens
                rates[name].append(num_tokens / elapsed)
                records = [json.loads(line) for line in trace.read_text().splitlines()[num_lines:]]
                # Decode-only steps: the prefill steps are the same in every batch.
                steps[name] += [r["duration_ms"] for r in records if r["num_prefill_tokens"] == 0]
    finally:
        llm.shutdown()
        shutil.rmtree(trace_dir, ignore_errors=True)
    results = {
        name: {
            "output_tok_per_s": statistics.median(rates[name]),
            "vs_plain": statistics.median(rates[name]) / statistics.median(rates["plain"]),
            "step_p50_ms": _percentile(steps[name], 0.5),
            "step_p99_ms": _percentile(steps[name], 0.99),
        }
        for name in batches
    }
    return {
        "machine": machine_info(),
        "config": {
            "model": model,
            "num_requests": args.num_requests,
            "prompt_len": PROMPT_LEN,
            "output_len": args.output_len,
            "rounds": args.rounds,
            "schema": SCHEMA,
        },  # fmt: skip
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks structured", description=__doc__)
    parser.add_argument("--model", type=Path, help="model directory (default: the bench model)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    report = run(args)
    if print_report_start(report, args.json):
        return 0
    print(f"{'batch':<8} {'out tok/s':>10} {'vs plain':>9} {'step p50':>10} {'step p99':>10}")
    for name, row in report["results"].items():
        print(
            f"{name:<8} {row['output_tok_per_s']:>10.0f} {row['vs_plain']:>8.2f}x"
            f" {row['step_p50_ms']:>8.1f}ms {row['step_p99_ms']:>8.1f}ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
