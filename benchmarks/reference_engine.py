"""The reference engine's side of `python -m benchmarks reference`: vLLM's LLM.generate, timed.

Runs in its own process under the reference engine's Python (a venv with vLLM's CPU build, see
scripts/install_reference_engine.sh), so it imports nothing from conveyor: it is started as a
script by path. It builds one engine, then answers one JSON line per JSON line on stdin:

    {"prompts_file": PATH}  ->  {"seconds": ..., "num_prompt_tokens": ..., "num_output_tokens": ...}

It is run from a copy in a temporary folder: Python puts a script's folder first on sys.path,
and this one's (benchmarks/, with a tokenize.py) would shadow the standard library's tokenize.
PATH holds {"prompts": [[token ids]...], "max_tokens": [...]}; every request is greedy
with ignore_eos, so the reference produces exactly the tokens conveyor does. vLLM logs to
stdout; the answers go to a copy of the original stdout taken before anything is imported, and
everything else is sent to stderr so it cannot corrupt them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _answer_stream():
    """The original stdout for answers; fd 1 then points at stderr for every library's logs."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return answers


# torch's CPU feature queries vLLM's CPU build reads to pick its AVX2 or AVX-512 kernel library
# and its attention and GEMM variants; they read the hardware.
CPU_FEATURE_QUERIES = (
    "_is_avx512_supported",
    "_is_avx512_bf16_supported",
    "_is_avx512_vnni_supported",
    "_is_amx_tile_supported",
    "_is_amx_fp16_supported",
)


def hold_to_avx2() -> bool:
    """Under CONVEYOR_CPU_ISA=avx2 (conveyor's runtime/cpu_isa.py; the benchmark passes it on):
    answer those queries as an AVX2-only CPU would, before vLLM is imported, so it loads and
    runs what it runs on one (torch, oneDNN and MKL get their limits from the environment)."""
    if os.environ.get("CONVEYOR_CPU_ISA", "").strip().lower() != "avx2":
        return False
    import torch.cpu

    for query in CPU_FEATURE_QUERIES:
        if hasattr(torch.cpu, query):
            setattr(torch.cpu, query, lambda: False)
    return True


# At import: vLLM's worker processes are spawned, and a spawned child imports the parent's main
# script (this one, as __mp_main__) before anything of vLLM, so they are held too.
HELD_TO_AVX2 = hold_to_avx2()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-dtype", default="auto", help="vLLM's kv_cache_dtype")
    parser.add_argument("--prefix-caching", choices=("on", "off"), default="on")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def build_engine(args: argparse.Namespace):
    from vllm import LLM

    return LLM(
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.prefix_caching == "on",
        seed=args.seed,
    )


def timed_generate(llm, prompts_file: str) -> dict[str, object]:
    from vllm import SamplingParams

    with open(prompts_file) as f:
        batch = json.load(f)
    prompts = [{"prompt_token_ids": ids} for ids in batch["prompts"]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in batch["max_tokens"]
    ]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "num_prompt_tokens": sum(len(ids) for ids in batch["prompts"]),
        "num_output_tokens": sum(len(c.token_ids) for o in outputs for c in o.outputs),
    }


def main(argv: list[str] | None = None) -> int:
    answers = _answer_stream()
    args = parse_args(argv)
    if HELD_TO_AVX2:
        print("held to AVX2: torch's AVX-512 and AMX queries answer False", file=sys.stderr)
    llm = build_engine(args)
    import vllm

    answers.write(json.dumps({"ready": True, "version": vllm.__version__}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        answers.write(json.dumps(timed_generate(llm, request["prompts_file"])) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
