"""The ``conveyor`` command: one subcommand per program, in the habits of ``vllm serve`` and
``vllm bench``.

    conveyor serve [MODEL] ...         the OpenAI-compatible server (supervisor, engine, frontends)
    conveyor frontend --engine ADDR    one more HTTP frontend for a running engine
    conveyor generate PROMPT           one completion, offline
    conveyor bench serve ...           the load generator, against any OpenAI-compatible server
    conveyor bench offline|scheduler|wire|attention|layers|moe|tokenize|structured|metrics|router
    conveyor bench fake-server         a fake OpenAI-compatible server with set delays
    conveyor make-model OUT            a random-weight test model in Hugging Face format
    conveyor keys generate DIR         CURVE keys for traffic between hosts
    conveyor gpu-check [--dry-run]     CUDA tests and a decode/prefill table on a GPU machine
    conveyor plot-trace FILE           draw a --trace-steps file

Runs in the process the user starts (also as ``python -m entrypoints.cli``). Each subcommand keeps
its own flags (``conveyor serve --help``); it is imported only when it runs, so ``conveyor --help``
is instant and ``conveyor bench serve`` never loads the engine.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version

from runtime import cpu_isa

Main = Callable[[list[str]], int]


def _serve(argv: list[str]) -> int:
    from entrypoints.serve import main

    return main(argv)


def _frontend(argv: list[str]) -> int:
    from frontend.server.main import parse_args, run

    description = "One more OpenAI-compatible HTTP frontend for a running engine."
    return run(parse_args(argv, "conveyor frontend", description))


def _generate(argv: list[str]) -> int:
    from entrypoints.generate import main

    return main(argv)


def _make_model(argv: list[str]) -> int:
    from entrypoints.make_model import main

    return main(argv)


def _keys(argv: list[str]) -> int:
    from entrypoints.keys import main

    return main(argv)


def _gpu_check(argv: list[str]) -> int:
    from entrypoints.gpu_check import main

    return main(argv)


def _plot_trace(argv: list[str]) -> int:
    from benchmarks.plot_trace import main

    return main(argv)


def _bench_serve(argv: list[str]) -> int:
    from benchmarks.loadgen.main import main

    return main(argv)


def _bench_offline(argv: list[str]) -> int:
    from benchmarks.offline import main

    return main(argv)


def _bench_reference(argv: list[str]) -> int:
    from benchmarks.reference import main

    return main(argv)


def _bench_scheduler(argv: list[str]) -> int:
    from benchmarks.scheduler import main

    return main(argv)


def _bench_step_budget(argv: list[str]) -> int:
    from benchmarks.step_budget import main

    return main(argv)


def _bench_scaleout(argv: list[str]) -> int:
    from benchmarks.scaleout.cli import main

    return main(argv)


def _bench_wire(argv: list[str]) -> int:
    from benchmarks.wire import main

    return main(argv)


def _bench_attention(argv: list[str]) -> int:
    from benchmarks.attention import main

    return main(argv)


def _bench_layers(argv: list[str]) -> int:
    from benchmarks.layers import main

    return main(argv)


def _bench_moe(argv: list[str]) -> int:
    from benchmarks.moe import main

    return main(argv)


def _bench_tokenize(argv: list[str]) -> int:
    from benchmarks.tokenize import main

    return main(argv)


def _bench_structured(argv: list[str]) -> int:
    from benchmarks.structured import main

    return main(argv)


def _bench_metrics(argv: list[str]) -> int:
    from benchmarks.metrics_cost import main

    return main(argv)


def _bench_router(argv: list[str]) -> int:
    from benchmarks.router import main

    return main(argv)


def _bench_fake_server(argv: list[str]) -> int:
    from benchmarks.loadgen.fake_server import main

    return main(argv)


COMMANDS: dict[str, tuple[Main, str]] = {
    "serve": (_serve, "serve a model over an OpenAI-compatible HTTP API"),
    "frontend": (_frontend, "one more HTTP frontend attached to a running engine"),
    "generate": (_generate, "one completion for one prompt, offline"),
    "make-model": (_make_model, "write a random-weight test model in Hugging Face format"),
    "keys": (_keys, "CURVE keys for ZeroMQ traffic between hosts: conveyor keys generate DIR"),
    "gpu-check": (_gpu_check, "on a GPU machine: CUDA tests, then decode/prefill speed as a table"),
    "plot-trace": (_plot_trace, "draw a --trace-steps file: batch composition over time"),
}
BENCH_COMMANDS: dict[str, tuple[Main, str]] = {
    "serve": (_bench_serve, "load generator for any OpenAI-compatible server (vllm bench serve)"),
    "offline": (_bench_offline, "offline throughput through LLM.generate"),
    "reference": (_bench_reference, "conveyor against vLLM's CPU build, interleaved, ratios"),
    "scheduler": (_bench_scheduler, "the scheduler's cost per step, no model"),
    "step-budget": (_bench_step_budget, "what a TBT SLO adds to schedule(), no model"),
    "scaleout": (_bench_scaleout, "1 to 16 simulated engines behind the router, per policy"),
    "wire": (_bench_wire, "bytes per step of the engine -> worker diff"),
    "attention": (_bench_attention, "attention against matmul time per layer"),
    "layers": (_bench_layers, "the model's token-wise ops on CPU"),
    "moe": (_bench_moe, "ways to run a mixture-of-experts layer's experts on CPU"),
    "tokenize": (_bench_tokenize, "tokenizing on the event loop, in threads or in processes"),
    "structured": (_bench_structured, "output tok/s with and without a JSON-schema constraint"),
    "metrics": (_bench_metrics, "output tok/s through the server with metrics on and off"),
    "router": (_bench_router, "the data-parallel router's cost per request, no engine"),
    "fake-server": (_bench_fake_server, "a fake OpenAI-compatible server with set delays"),
}


def _add_commands(
    parser: argparse.ArgumentParser, commands: dict[str, tuple[Main, str]], dest: str
) -> argparse._SubParsersAction:
    subparsers = parser.add_subparsers(dest=dest, metavar="COMMAND", required=True)
    for name, (_, help_text) in commands.items():
        # Each command parses its own flags (and --help): they pass through untouched.
        subparsers.add_parser(name, help=help_text, description=help_text, add_help=False)
    return subparsers


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="conveyor",
        description="conveyor: an LLM serving engine with an OpenAI-compatible API.",
        epilog="Run 'conveyor COMMAND --help' for a command's flags.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    subparsers = _add_commands(parser, COMMANDS, "command")
    help_text = "benchmarks: the load generator and the engine's own"
    bench = subparsers.add_parser("bench", help=help_text, description=help_text)
    _add_commands(bench, BENCH_COMMANDS, "bench_command")
    return parser


def _version() -> str:
    try:
        return version("conveyor-llm")
    except PackageNotFoundError:
        return "(not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(argv)
    # Before anything imports torch: its kernels, oneDNN and MKL read these once, at first use.
    try:
        cpu_isa.apply()
    except ValueError as error:
        print(f"conveyor: {error}", file=sys.stderr)
        return 2
    if args.command == "bench":
        run = BENCH_COMMANDS[args.bench_command][0]
    else:
        run = COMMANDS[args.command][0]
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
