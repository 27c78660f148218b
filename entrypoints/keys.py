"""``conveyor keys generate DIR``: a CURVE key pair for this host, for traffic between hosts.

Runs in the process the user starts. Writes DIR/node.key_secret (0600) and DIR/node.key, and
makes DIR/authorized/ for the other hosts' public keys; then says what to copy where. The folder
is what ``--curve-keys DIR`` (or $CONVEYOR_CURVE_KEYS) names; ``runtime.zmq_security`` reads it.
"""

from __future__ import annotations

import argparse

from conveyor.runtime.exit_codes import ExitCode
from conveyor.runtime.zmq_security import (
    AUTHORIZED_DIR,
    HEAD_KEY_FILE,
    CurveKeysError,
    generate_keys,
    load_keys,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="conveyor keys",
        description="CURVE keys for ZeroMQ traffic between hosts (docs/serving.md, Multiple hosts).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate = commands.add_parser("generate", help="make this host's key pair in DIR")
    generate.add_argument("directory", metavar="DIR")
    show = commands.add_parser("show", help="print the public keys DIR holds and trusts")
    show.add_argument("directory", metavar="DIR")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "generate":
            public_file = generate_keys(args.directory)
            print(f"wrote {public_file}_secret (keep it here) and {public_file} (public)")
            print(
                f"copy {public_file} into {AUTHORIZED_DIR}/ on every other host (any name ending "
                f"in .key; on hosts other than the head, the head's key as {HEAD_KEY_FILE})"
            )
        else:
            keys = load_keys(args.directory)
            print(f"this host: {keys.public_key.decode()}")
            print(f"the head:  {keys.head_key.decode()}")
            for key in sorted(keys.authorized_keys):
                print(f"authorized: {key.decode()}")
    except (CurveKeysError, OSError) as exc:
        print(f"conveyor keys: {exc}")
        return ExitCode.BAD_CONFIG
    return ExitCode.OK
