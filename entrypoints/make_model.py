"""``conveyor make-model OUT``: a deterministic random-weight model in Hugging Face format.

    conveyor make-model OUT --size tiny|small|bench|qwen3-0.6b [--arch ARCH] [--seed N]

ARCH: qwen3 (default), qwen2, llama, mistral, phi3, gemma3, qwen3_moe, mixtral
(worker/model_maker.py says what each exercises).

Runs in the caller's process. The directory loads with transformers' AutoModelForCausalLM /
AutoTokenizer and with conveyor; tests and benchmarks use these models (see worker/model_maker.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from worker.model_maker import ARCHITECTURES, SIZES, model_config, write_model_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="conveyor make-model",
        description="Write a deterministic random-weight model directory in Hugging Face format.",
    )
    parser.add_argument("out", type=Path, help="directory to create (must not exist or be empty)")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument(
        "--arch",
        choices=sorted(ARCHITECTURES),
        default="qwen3",
        help="model family (tiny and small only; bench and qwen3-0.6b are Qwen3)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        model_config(args.size, args.arch)
    except ValueError as error:
        parser.error(str(error))
    start = time.perf_counter()
    out = write_model_dir(args.out, args.size, args.arch, args.seed)
    config = model_config(args.size, args.arch)
    print(
        f"wrote {config['architectures'][0]} ({args.size}, seed {args.seed}) to {out} "
        f"in {time.perf_counter() - start:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
