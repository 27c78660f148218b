"""Per-op breakdown of a worker's forward passes from a py-spy profile of the whole engine.

Runs standalone, on a file. Record the engine with py-spy's raw (collapsed) output, following
its child processes and showing native frames, then read the worker's share:

    py-spy record --subprocesses --native -r 50 -f raw -o prof.txt -- \\
        conveyor bench offline --model DIR --workload long --num-requests 16
    python -m benchmarks stack-profile prof.txt

Only the worker's main thread is sampled with Python frames (the OpenMP threads an op wakes have
none), so a category's share is the share of the forward pass's wall time spent inside that op,
both cores together. Samples outside ``Worker.execute_model`` (start-up, waiting for the next
step) are left out. The first matching rule names a sample, in the order listed.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter

RULES: tuple[tuple[str, str], ...] = (
    ("attention: compiled kernel", r"PagedAttentionKernel\.attend\b"),
    ("attention: KV write", r"write_kv"),
    ("attention: prompt chunks, SDPA over gathered K/V", r"_attend_prefill"),
    ("attention: decode chunks, SDPA over gathered K/V", r"_attend_decode_chunk"),
    ("attention: planning, other", r"TorchAttentionBackend\.forward"),
    ("GEMMs (linears, LM head)", r"(Linear|linear|gemm|compute_logits)"),
    ("RMSNorm", r"(RMSNorm|rms_norm)"),
    ("RoPE, q/k norm", r"(rotary|Rotary|rotate_|qk_norm)"),
    ("SiLU x mul", r"(SiluAndMul|silu)"),
    ("embedding", r"[Ee]mbed"),
    ("sampler", r"(Sampler|sample)"),
    ("model, other ops", r"DecoderForCausalLM\.forward"),
    ("runner: inputs, outputs (Python)", r"ModelRunner"),
)


def breakdown(lines: list[str], scope: str = "Worker.execute_model") -> Counter[str]:
    """Samples per category among the stacks that pass through ``scope``."""
    totals: Counter[str] = Counter()
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if scope not in stack or not count.isdigit():
            continue
        name = next((n for n, pattern in RULES if re.search(pattern, stack)), "other")
        totals[name] += int(count)
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks stack-profile", description=__doc__.splitlines()[0]
    )
    parser.add_argument("profile", help="py-spy record -f raw output")
    parser.add_argument("--scope", default="Worker.execute_model", help="frame to count under")
    args = parser.parse_args(argv)
    with open(args.profile) as f:
        totals = breakdown(f.readlines(), args.scope)
    total = sum(totals.values())
    if not total:
        print(f"no samples under {args.scope}", file=sys.stderr)
        return 1
    for name, count in totals.most_common():
        print(f"{name:<52}{count:>7}{100 * count / total:>7.1f} %")
    print(f"{'samples':<52}{total:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
