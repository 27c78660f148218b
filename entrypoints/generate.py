"""``conveyor generate PROMPT``: one completion from the command line, through ``LLM``.

    conveyor generate "def main():" --max-tokens 32
    conveyor generate --model /path/to/hf_dir "Hello" --temperature 0.8 --sample-seed 1

Runs in the caller's process (the engine in its own). Without --model, the embedded default model.
"""

from __future__ import annotations

import argparse
import sys

from conveyor.frontend import LLM
from conveyor.frontend.engine_args import EngineArgs, add_engine_args
from conveyor.protocol import SamplingParams
from conveyor.runtime.flags import finite_float, non_negative_float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="conveyor generate", description="One completion for one prompt (offline)."
    )
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=finite_float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sample-seed", type=int, default=None, help="per-request seed")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    add_engine_args(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
