"""Generate a completion for one prompt from the command line (offline, in-process engine).

    python scripts/generate.py "The capital of France is" --max-tokens 32
    python scripts/generate.py --model /path/to/hf_dir "Hello" --temperature 0.8 --seed 1

Without --model the default tiny model is used (made on first use).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from frontend import LLM  # noqa: E402
from frontend.engine_args import EngineArgs, add_engine_args  # noqa: E402
from protocol import SamplingParams  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sample-seed", type=int, default=None, help="per-request seed")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    add_engine_args(parser)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    engine_args = EngineArgs.from_cli(args)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sample_seed,
        max_tokens=args.max_tokens,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    kwargs = {k: v for k, v in vars(engine_args).items() if k != "model"}
    with LLM(engine_args.model, **kwargs) as llm:
        (output,) = llm.generate(args.prompt, params, use_tqdm=False)
    completion = output.outputs[0]
    print(completion.text)
    print(
        f"[{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
