"""``conveyor bench offline --compare-spec``: output tok/s with and without speculative decoding
on a copying workload, and the drafts' acceptance rate, at several batch sizes.

The copying workload: each prompt is a real source file's text (the engine's own, so every
installation has them) followed by its first lines again, so the model's greedy continuation
copies the file on. The two engines (one without speculation, one with ``--speculative-config``,
default vLLM's documented ngram example, k=5 over 4-grams, with the off-switch out of the way) run the same prompts, interleaved
``--repeats`` times, at each ``--batch-sizes`` value: same-run ratios, robust to a shared host.
With a draft model, a third engine runs the draft alone on the same prompts, interleaved with
the others: its cost per token relative to the target's (plain tok/s / draft tok/s) is what
bounds the gain, with the acceptance rate.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from conveyor import engine_core, frontend, worker
from conveyor.bench.machine import Timing, machine_info
from conveyor.frontend import LLM
from conveyor.protocol import SamplingParams

# vLLM's documented n-gram example (k = 5, 4-grams: prompt_lookup_min follows the max).
DEFAULT_SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 5,
    "prompt_lookup_max": 4,
    # Speculate at every batch size: the point is to measure where it stops paying.
    "disable_by_batch_size": 1 << 20,
}
# Characters of each file in the prompt, and of its first lines repeated after it.
FILE_CHARS = 2400
REPEAT_CHARS = 240


def copy_prompts(tokenizer, count: int) -> list[list[int]]:
    """``count`` prompts, each a source file's first FILE_CHARS characters, a blank line, then
    its first REPEAT_CHARS characters again (the model copies from there)."""
    folders = [Path(package.__file__).parent for package in (engine_core, frontend, worker)]
    files = sorted(p for f in folders for p in f.rglob("*.py") if p.stat().st_size > FILE_CHARS)
    prompts = []
    for i in range(count):
        text = files[i % len(files)].read_text()[:FILE_CHARS]
        prompts.append(tokenizer.encode(text + "\n\n" + text[:REPEAT_CHARS]))
    return prompts


def random_prompts(vocab_size: int, count: int, length: int = 600) -> list[list[int]]:
    """Random-token prompts (seeded): text that nothing copies, where drafts are rarely right;
    what speculation costs when it does not pay."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab_size, length).tolist() for _ in range(count)]


def _run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = llm.stats
    with Timing() as timing:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    after = llm.stats
    num_output = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    run = {"output_tok_s": round(num_output / timing.seconds, 1), **timing.summary()}
    if after is not None and after.spec_num_draft_tokens:
        drafts = after.spec_num_draft_tokens - (before.spec_num_draft_tokens if before else 0)
        accepted = after.spec_num_accepted_tokens - (
            before.spec_num_accepted_tokens if before else 0
        )
        run["acceptance"] = round(accepted / drafts, 3) if drafts else 0.0
    return run


def compare_spec(args: argparse.Namespace, engine_kwargs: dict[str, object]) -> int:
    spec = json.loads(args.speculative_config) if args.speculative_config else DEFAULT_SPEC
    base = {k: v for k, v in engine_kwargs.items() if k != "speculative_config"}
    sizes = [int(size) for size in args.batch_sizes.split(",")]
    base.setdefault("max_num_seqs", max(sizes))
    llms = {
        "plain": LLM(args.model, engine=args.engine, **base),
        "spec": LLM(args.model, engine=args.engine, speculative_config=spec, **base),
    }
    if spec.get("model") is not None:
        # The draft alone, in the weights' format it drafts in.
        draft = {**base, "quantization": spec.get("quantization")}
        llms["draft"] = LLM(spec["model"], engine=args.engine, **draft)
    results = []
    try:
        tokenizer = llms["plain"].get_tokenizer()
        warmup = copy_prompts(tokenizer, 2)
        for llm in llms.values():
            llm.generate(warmup, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        vocab_size = min(len(tokenizer), llms["plain"].config.model.vocab_size)
        for size in sizes:
            if args.spec_workload == "copy":
                prompts = copy_prompts(tokenizer, size)
            else:
                prompts = random_prompts(vocab_size, size)
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in llms}
            for _ in range(args.repeats):
                for name, llm in llms.items():
                    runs[name].append(_run(llm, prompts, args.spec_max_tokens))
            best = {name: max(r["output_tok_s"] for r in rs) for name, rs in runs.items()}
            row = {
                "batch": size,
                "plain_tok_s": best["plain"],
                "spec_tok_s": best["spec"],
                "ratio": round(best["spec"] / best["plain"], 3),
                "acceptance": runs["spec"][-1].get("acceptance", 0.0),
                "runs": runs,
            }
            if "draft" in best:
                row["draft_cost"] = round(best["plain"] / best["draft"], 3)
            results.append(row)
    finally:
        for llm in llms.values():
            llm.shutdown()
    report = {
        "workload": args.spec_workload,
        "speculative_config": spec,
        "max_tokens": args.spec_max_tokens,
        "results": results,
        "config": {k: v for k, v in base.items() if v is not None},
        "machine": machine_info(),
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print("machine:", ", ".join(f"{k}={v}" for k, v in report["machine"].items()))
    print(
        f"{args.spec_workload} workload, {args.spec_max_tokens} output tokens, best of {args.repeats}; {spec}"
    )
    print(
        f"{'batch':>6} {'plain tok/s':>12} {'spec tok/s':>11} {'ratio':>6} {'accepted':>9}"
        + (f" {'draft cost':>10}" if "draft" in llms else "")
    )
    for row in results:
        print(
            f"{row['batch']:>6} {row['plain_tok_s']:>12} {row['spec_tok_s']:>11} "
            f"{row['ratio']:>6} {100 * row['acceptance']:>8.1f}%"
            + (f" {row['draft_cost']:>10}" if "draft_cost" in row else "")
        )
    return 0
