"""The ``conveyor`` command: one subcommand per program, in the habits of ``vllm serve`` and
``vllm bench``.

    conveyor serve [MODEL] ...         the OpenAI-compatible server (supervisor, engine, frontends)
    conveyor frontend --engine ADDR    one more HTTP frontend for a running engine
    conveyor generate PROMPT           one completion, offline
    conveyor bench serve ...           the load generator, against any OpenAI-compatible server
    conveyor bench offline ...         offline throughput through LLM.generate
    conveyor keys generate DIR         CURVE keys for traffic between hosts
    conveyor plot-trace FILE           draw a --trace-steps file

Runs in the process the user starts (also as ``python -m conveyor``). Each subcommand keeps its
own flags (``conveyor serve --help``); its module is imported only when it runs, so ``conveyor
--help`` is instant and ``conveyor bench serve`` never loads the engine. The lab's commands
(micro-benchmarks, studies, the GPU check, test models) are run from a checkout with ``python -m
benchmarks``, through ``dispatch`` below.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from conveyor.runtime import cpu_isa


@dataclass(frozen=True)
class Command:
    """A subcommand: the module whose ``main(argv) -> int`` runs it, and its one-line help."""

    module: str
    help: str

    def run(self, argv: list[str]) -> int:
        return importlib.import_module(self.module).main(argv)


CommandTable = dict[str, "Command | CommandTable"]

COMMANDS: CommandTable = {
    "serve": Command(
        "conveyor.entrypoints.serve", "serve a model over an OpenAI-compatible HTTP API"
    ),
    "frontend": Command(
        "conveyor.frontend.server.main", "one more HTTP frontend attached to a running engine"
    ),
    "generate": Command("conveyor.entrypoints.generate", "one completion for one prompt, offline"),
    "bench": {
        "serve": Command(
            "conveyor.bench.loadgen.main",
            "load generator for any OpenAI-compatible server (vllm bench serve)",
        ),
        "offline": Command("conveyor.bench.offline", "offline throughput through LLM.generate"),
    },
    "keys": Command(
        "conveyor.entrypoints.keys",
        "CURVE keys for ZeroMQ traffic between hosts: conveyor keys generate DIR",
    ),
    "plot-trace": Command(
        "conveyor.bench.plot_trace", "draw a --trace-steps file: batch composition over time"
    ),
}
GROUP_HELP = {"bench": "benchmarks: the load generator and offline throughput"}


def _add_commands(parser: argparse.ArgumentParser, commands: CommandTable, depth: int) -> None:
    subparsers = parser.add_subparsers(dest=f"command_{depth}", metavar="COMMAND", required=True)
    for name, entry in commands.items():
        if isinstance(entry, Command):
            # Each command parses its own flags (and --help): they pass through untouched.
            # argparse %-formats a help line ("70 % of ..." broke `--help`): escape it.
            subparsers.add_parser(
                name, help=entry.help.replace("%", "%%"), description=entry.help, add_help=False
            )
        else:
            help_text = GROUP_HELP.get(name, name)
            group = subparsers.add_parser(name, help=help_text, description=help_text)
            _add_commands(group, entry, depth + 1)


def build_parser(
    prog: str = "conveyor",
    commands: CommandTable = COMMANDS,
    description: str = "conveyor: an LLM serving engine with an OpenAI-compatible API.",
) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=description, epilog=f"Run '{prog} COMMAND --help' for its flags."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    _add_commands(parser, commands, 0)
    return parser


def _version() -> str:
    try:
        return version("conveyor-llm")
    except PackageNotFoundError:
        return "(not installed)"


def dispatch(
    parser: argparse.ArgumentParser, commands: CommandTable, argv: Sequence[str] | None
) -> int:
    """Parse the command's name, then run it with the rest of the arguments."""
    args, rest = parser.parse_known_args(argv)
    # Before anything imports torch: its kernels, oneDNN and MKL read these once, at first use.
    try:
        cpu_isa.apply()
    except ValueError as error:
        print(f"{parser.prog}: {error}", file=sys.stderr)
        return 2
    entry: Command | CommandTable = commands
    depth = 0
    while not isinstance(entry, Command):
        entry = entry[getattr(args, f"command_{depth}")]
        depth += 1
    return entry.run(rest)


def main(argv: Sequence[str] | None = None) -> int:
    return dispatch(build_parser(), COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
