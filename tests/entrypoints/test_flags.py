"""Every float flag of every command refuses NaN and infinity at start-up.

Runs in the test process, in milliseconds (the parsers are built, never run). The flags are
found by building each command's parser, so a float flag added later is covered without a word
here: one written with ``type=float`` fails these tests (use ``conveyor.runtime.flags``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from unittest import mock

import pytest

from conveyor.bench import offline
from conveyor.entrypoints import engine, generate, serve
from conveyor.frontend.server import main as frontend_main

# Each command's parse_args and the arguments it cannot parse without.
COMMANDS: dict[str, tuple[Callable[[list[str]], argparse.Namespace], list[str]]] = {
    "conveyor serve": (serve.parse_args, []),
    "conveyor frontend": (frontend_main.parse_args, ["--engine", "ipc:///nowhere"]),
    "conveyor generate": (generate.parse_args, ["a prompt"]),
    "conveyor bench offline": (offline.parse_args, []),
    "engine process": (engine.parse_args, ["--config-file", "f", "--address", "ipc:///nowhere"]),
}


class _Built(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def parser_of(parse_args: Callable[[list[str]], argparse.Namespace]) -> argparse.ArgumentParser:
    """The parser ``parse_args`` builds, caught as it is about to parse."""

    def built(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise _Built(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", built):
        try:
            parse_args([])
        except _Built as caught:
            return caught.parser
    raise AssertionError(f"{parse_args} parsed without building a parser")


def float_flags(parser: argparse.ArgumentParser) -> Iterator[str]:
    """The options whose type makes a float of some number."""
    for action in parser._actions:
        if not action.option_strings or not callable(action.type):
            continue
        for probe in ("0.5", "1.5", "1000.5"):
            try:
                value = action.type(probe)
            except (ValueError, TypeError, argparse.ArgumentTypeError):
                continue
            if isinstance(value, float):
                yield max(action.option_strings, key=len)
                break


PARSERS = {name: parser_of(parse_args) for name, (parse_args, _) in COMMANDS.items()}
FLOAT_FLAGS = [(name, flag) for name, parser in PARSERS.items() for flag in float_flags(parser)]


def test_the_float_flags_are_found():
    found = set(FLOAT_FLAGS)
    for expected in [
        ("conveyor serve", "--tbt-slo-ms"),
        ("conveyor serve", "--drain-timeout-s"),
        ("conveyor serve", "--router-affinity-margin"),
        ("conveyor frontend", "--request-read-timeout-s"),
        ("conveyor generate", "--temperature"),
        ("conveyor bench offline", "--step-timeout-s"),
        ("engine process", "--heartbeat-timeout-s"),
    ]:
        assert expected in found


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "Infinity"])
@pytest.mark.parametrize("command, flag", FLOAT_FLAGS, ids=[" ".join(f) for f in FLOAT_FLAGS])
def test_every_float_flag_refuses_nan_and_infinity(command, flag, value, capsys):
    parser = PARSERS[command]
    required = COMMANDS[command][1]
    with pytest.raises(SystemExit) as exited:
        # --flag=VALUE: a "-inf" on its own would read as an unknown option instead.
        parser.parse_args([*required, f"{flag}={value}"])
    assert exited.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["nanM", "infG", "-1M", "0"])
def test_the_byte_size_flag_refuses_what_is_no_size(value, capsys):
    parser = PARSERS["conveyor serve"]
    with pytest.raises(SystemExit) as exited:
        parser.parse_args([f"--kv-cache-memory={value}"])
    assert exited.value.code == 2
    assert "argument --kv-cache-memory" in capsys.readouterr().err


def test_finite_values_still_parse():
    args = PARSERS["conveyor serve"].parse_args(
        ["--tbt-slo-ms", "25", "--step-timeout-s", "0", "--kv-cache-memory", "1.5G"]
    )
    assert (args.tbt_slo_ms, args.step_timeout_s, args.kv_cache_memory) == (25.0, 0.0, 3 << 29)


@pytest.mark.parametrize("table", ["conveyor", "benchmarks"])
def test_the_command_lists_print(table, capsys):
    """`conveyor --help` and `python -m benchmarks --help` list every command (a help line with
    a bare % once made argparse raise instead)."""
    from conveyor.entrypoints import cli

    if table == "conveyor":
        parser, commands = cli.build_parser(), cli.COMMANDS
    else:
        from benchmarks.__main__ import COMMANDS

        parser, commands = cli.build_parser("python -m benchmarks", COMMANDS), COMMANDS
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--help"])
    assert exited.value.code == 0
    printed = capsys.readouterr().out
    assert all(name in printed for name in commands)
