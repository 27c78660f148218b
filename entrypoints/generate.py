"""``conveyor generate PROMPT``: one completion from the command line, through ``LLM``.

    conveyor generate "def main():" --max-tokens 32
    conveyor generate --model /path/to/hf_dir "Hello" --temperature 0.8 --sample-seed 1

Runs in the caller's process (the engine in its own). Without --model, the embedded default model.
What the flags leave out comes from the model's sampling defaults (its generation_config.json,
or --generation-config), then the API's, as a request to the server that leaves it out.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping

from conveyor.frontend import LLM
from conveyor.frontend.engine_args import EngineArgs, add_engine_args
from conveyor.protocol import SamplingParams
from conveyor.runtime.flags import finite_float, non_negative_float

# Tokens generated when neither --max-tokens nor the model's max_new_tokens says.
DEFAULT_MAX_TOKENS = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="conveyor generate", description="One completion for one prompt (offline)."
    )
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"default: the model's max_new_tokens, else {DEFAULT_MAX_TOKENS}",
    )
    parser.add_argument(
        "--temperature",
        type=non_negative_float,
        default=None,
        help="0 = greedy (default: the model's, else 1)",
    )
    parser.add_argument("--top-p", type=finite_float, default=None, help="default: the model's")
    parser.add_argument("--top-k", type=int, default=None, help="default: the model's")
    parser.add_argument("--sample-seed", type=int, default=None, help="per-request seed")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    add_engine_args(parser)
    return parser.parse_args(argv)


def sampling_params(
    args: argparse.Namespace, defaults: Mapping[str, int | float]
) -> SamplingParams:
    """The flags given, over the model's sampling ``defaults``, over SamplingParams' own."""
    given = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "max_tokens": args.max_tokens,
    }
    values = {"max_tokens": DEFAULT_MAX_TOKENS, **defaults}
    values.update({name: value for name, value in given.items() if value is not None})
    return SamplingParams(
        **values, seed=args.sample_seed, stop=args.stop, ignore_eos=args.ignore_eos
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    engine_args = EngineArgs.from_cli(args)
    kwargs = {k: v for k, v in vars(engine_args).items() if k != "model"}
    with LLM(engine_args.model, **kwargs) as llm:
        defaults = llm.config.model.sampling_defaults
        params = sampling_params(args, defaults)
        (output,) = llm.generate(args.prompt, params, use_tqdm=False)
    completion = output.outputs[0]
    print(completion.text)
    from_model = f"; the model's defaults: {_describe(defaults)}" if defaults else ""
    print(
        f"[{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}, "
        f"temperature={params.temperature}, top_p={params.top_p}, top_k={params.top_k}{from_model}]",
        file=sys.stderr,
    )
    return 0


def _describe(values: Mapping[str, int | float]) -> str:
    return ", ".join(f"{name}={value}" for name, value in sorted(values.items()))


if __name__ == "__main__":
    sys.exit(main())
