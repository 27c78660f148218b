"""One OpenAI-compatible HTTP frontend attached to a running engine: ``conveyor frontend``.

    conveyor frontend --engine ipc:///run/user/1000/conveyor-x/engine.sock --port 8000
    conveyor frontend --engine ADDRESS_0 --engine ADDRESS_1 --router least-loaded

Runs as an HTTP frontend process. Started N times by ``conveyor serve --frontends N`` (as
``python -m conveyor.frontend``), or by hand to add one more frontend to an engine that already
runs (its address is in the supervisor's ``ready: engine_core ...`` line). ``conveyor serve``'s
frontends accept on listening sockets it bound (``--listen-fd``, inherited); one started by
hand binds ``--host``/``--port`` itself, a port no other process holds. With several
data-parallel engines (one --engine each, as ``conveyor serve --data-parallel-size N`` prints
them), it is a client of all of them and routes each request to one (--router). vLLM's server
flags are taken too (TLS, CORS, --root-path, several --served-model-name and --api-key values;
``frontend.vllm_flags`` for the ones conveyor has no option for). SIGTERM/SIGINT drain: /health turns 503, in-flight requests get up to
--drain-timeout-s to finish, then the process exits 0. An engine that answers no heartbeat for
--engine-silence-timeout-s (stopped, swapped out), dropped this frontend, or died is attached
again as soon as it answers at its address (meanwhile /health and new requests get 503 saying
why); when no engine has answered for --engine-lost-timeout-s the frontend exits 4, on which its
supervisor stops everything.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from conveyor.frontend.engine_client.router import DEFAULT_AFFINITY_MARGIN, ROUTER_POLICIES
from conveyor.frontend.server.connection import DEFAULT_MAX_REQUEST_BODY_BYTES, ConnectionLimits
from conveyor.frontend.server.http_options import add_http_args, http_options
from conveyor.frontend.server.lora_modules import add_lora_module_args, runtime_updates_allowed
from conveyor.frontend.server.metrics_dir import ensure_multiprocess_dir
from conveyor.frontend.server.responses_store import StoreLimits
from conveyor.frontend.vllm_flags import (
    SERVER_FLAGS,
    FlagParser,
    add_vllm_flags,
    flags_without_effect,
    normalize_vllm_argv,
)
from conveyor.runtime.exit_codes import ExitCode
from conveyor.runtime.flags import float_at_least, non_negative_float, positive_float
from conveyor.runtime.logs import configure_logging
from conveyor.runtime.parent import tie_to_parent

# The API key may come from the environment, which, unlike a command line, other users cannot read
# (one key a line); vLLM's variable is read too.
API_KEY_ENV = "CONVEYOR_API_KEY"
VLLM_API_KEY_ENV = "VLLM_API_KEY"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def add_responses_store_args(parser: argparse._ActionsContainer) -> None:
    """How many responses of /v1/responses the server keeps, and for how long."""
    limits = StoreLimits()
    parser.add_argument(
        "--responses-store-size",
        type=_non_negative_int,
        default=limits.max_responses,
        metavar="N",
        help="keep the last N responses of /v1/responses for GET /v1/responses/{id} and "
        "previous_response_id, shared by every frontend (0: keep none; store: true is refused)",
    )
    parser.add_argument(
        "--responses-store-max-mib",
        type=positive_float,
        default=limits.max_bytes / (1 << 20),
        metavar="MIB",
        help="and at most this much of them (the oldest go first)",
    )
    parser.add_argument(
        "--responses-store-ttl-s",
        type=positive_float,
        default=limits.ttl_s,
        help="a stored response is forgotten this long after it was made",
    )


def responses_store_limits(args: argparse.Namespace) -> StoreLimits:
    return StoreLimits(
        args.responses_store_size,
        int(args.responses_store_max_mib * (1 << 20)),
        args.responses_store_ttl_s,
    )


def responses_store_options(args: argparse.Namespace) -> list[str]:
    """The store flags in ``args``, as command-line options again."""
    return [
        "--responses-store-size", str(args.responses_store_size),
        "--responses-store-max-mib", str(args.responses_store_max_mib),
        "--responses-store-ttl-s", str(args.responses_store_ttl_s),
    ]  # fmt: skip


def add_engine_session_args(parser: argparse._ActionsContainer) -> None:
    """How long a frontend waits for a silent engine, and for one that never comes back."""
    parser.add_argument(
        "--engine-silence-timeout-s",
        type=float_at_least(1.0),
        default=None,
        metavar="S",
        help="an engine that answers no heartbeat for S seconds (default 10) counts as down: "
        "its streams end with an error, /health and new requests get 503 saying so, and it is "
        "attached again as soon as it answers",
    )
    parser.add_argument(
        "--engine-lost-timeout-s",
        type=float_at_least(1.0),
        default=None,
        metavar="S",
        help="when no engine has answered for S seconds (default 300) the frontend exits "
        f"{int(ExitCode.ENGINE_LOST)}, and conveyor serve stops everything with exit 1",
    )


def engine_session_options(args: argparse.Namespace) -> list[str]:
    """The engine-session flags set in ``args``, as command-line options again."""
    options = []
    for name in ("engine_silence_timeout_s", "engine_lost_timeout_s"):
        value = getattr(args, name)
        if value is not None:
            options += [f"--{name.replace('_', '-')}", str(value)]
    return options


def add_api_key_args(parser: argparse._ActionsContainer) -> None:
    parser.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="require 'Authorization: Bearer KEY' on every route but /health, /metrics and "
        f"/version, KEY one of FILE's lines (or of ${API_KEY_ENV}'s, else ${VLLM_API_KEY_ENV})",
    )
    parser.add_argument(
        "--api-key",
        nargs="+",
        action="extend",
        default=None,
        metavar="KEY",
        help="the same, with any of these KEYs: visible to every local user in ps; prefer the file",
    )


def resolve_api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """Every key a request may bring: --api-key-file's lines, else --api-key's (with a warning:
    they show in ps), else $CONVEYOR_API_KEY's lines, else $VLLM_API_KEY. Empty: no key."""
    if args.api_key_file is not None:
        try:
            keys = _lines(args.api_key_file.read_text())
        except OSError as exc:
            raise SystemExit(f"--api-key-file: cannot read {args.api_key_file}: {exc}") from None
        if not keys:
            raise SystemExit(f"--api-key-file: {args.api_key_file} is empty")
        return keys
    if args.api_key:
        logging.getLogger("conveyor.frontend").warning(
            "--api-key on the command line can be read by every local user (ps); use "
            "--api-key-file FILE or $%s",
            API_KEY_ENV,
        )
        keys = _lines("\n".join(args.api_key))
        if len(keys) != len(args.api_key):
            raise SystemExit("--api-key: a key must not be empty or hold a line break")
        return keys
    return _lines(os.environ.get(API_KEY_ENV) or os.environ.get(VLLM_API_KEY_ENV) or "")


def api_key_env(keys: tuple[str, ...]) -> dict[str, str]:
    """The environment that hands ``keys`` to a frontend (never its command line)."""
    return {API_KEY_ENV: "\n".join(keys)} if keys else {}


def _lines(text: str) -> tuple[str, ...]:
    return tuple(line.strip() for line in text.splitlines() if line.strip())


def add_connection_args(parser: argparse._ActionsContainer) -> None:
    """Deadlines and caps for slow or hostile clients (``frontend.server.connection``)."""
    limits = ConnectionLimits()
    parser.add_argument(
        "--request-read-timeout-s",
        type=positive_float,
        default=limits.read_timeout_s,
        help="a request's headers must arrive within this of its first byte, its body within "
        f"this plus {limits.read_s_per_mib:g} s per MiB; else 408",
    )
    parser.add_argument(
        "--keep-alive-timeout-s",
        type=positive_float,
        default=limits.idle_timeout_s,
        help="close a connection that sends nothing for this long",
    )
    parser.add_argument(
        "--max-header-bytes",
        type=_positive_int,
        default=limits.max_header_bytes,
        help="431 for request headers larger than this",
    )


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    return ConnectionLimits(
        idle_timeout_s=args.keep_alive_timeout_s,
        read_timeout_s=args.request_read_timeout_s,
        max_body_bytes=args.max_request_body_bytes,
        max_header_bytes=args.max_header_bytes,
    )


def add_frontend_process_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of one frontend process (``conveyor frontend``, ``python -m conveyor.frontend``)."""
    parser.add_argument(
        "--engine",
        required=True,
        action="append",
        metavar="ADDRESS",
        help="an engine's address (ipc:// or tcp://); once per data-parallel engine, in order",
    )
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--listen-fd",
        type=int,
        default=None,
        help=argparse.SUPPRESS,  # conveyor serve's: the listening socket it bound (inherited)
    )
    add_api_key_args(parser)
    parser.add_argument(
        "--max-queued-requests",
        type=_positive_int,
        default=None,
        help="answer 429 while this many generation requests are in flight in this frontend",
    )
    add_served_model_name_arg(parser, "its path")
    add_lora_module_args(parser)
    parser.add_argument(
        "--max-request-body-bytes", type=_positive_int, default=DEFAULT_MAX_REQUEST_BODY_BYTES
    )
    add_drain_args(parser)
    add_router_args(parser)
    add_connection_args(parser)
    parser.add_argument(
        "--engine-ready-timeout-s",
        type=positive_float,
        default=30.0,
        help="give up attaching after this",
    )
    add_engine_session_args(parser)
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when it dies")
    parser.add_argument("--ready-file", type=Path, default=None, help="written once serving")
    add_observability_args(parser)
    add_responses_store_args(parser)
    add_http_args(parser)
    add_vllm_flags(parser, SERVER_FLAGS)
    parser.add_argument("--log-level", default=None, help="default: $CONVEYOR_LOG_LEVEL or INFO")
    return parser


def add_served_model_name_arg(parser: argparse._ActionsContainer, default: str) -> None:
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model's names in the API: requests may use any, /v1/models lists each, "
        f"responses carry the first (default: {default})",
    )


def add_drain_args(parser: argparse._ActionsContainer) -> None:
    parser.add_argument(
        "--drain-timeout-s",
        type=non_negative_float,
        default=5.0,
        help="on SIGTERM: how long in-flight requests may run on before they are aborted",
    )
    parser.add_argument(  # vLLM's name for it (whole seconds there)
        "--shutdown-timeout",
        dest="drain_timeout_s",
        type=non_negative_float,
        default=argparse.SUPPRESS,
        help="the same as --drain-timeout-s",
    )


def add_router_args(parser: argparse._ActionsContainer) -> None:
    """How a frontend picks the data-parallel engine of each request (``engine_client.router``)."""
    parser.add_argument(
        "--router",
        choices=ROUTER_POLICIES,
        default=ROUTER_POLICIES[0],
        help="with several engines: prefix-affinity (the engine that last served the prompt's "
        "first KV blocks, unless it is more loaded than the least loaded by the margin), "
        "least-loaded (fewest waiting + running requests) or round-robin",
    )
    parser.add_argument(
        "--router-affinity-margin",
        type=non_negative_float,
        default=DEFAULT_AFFINITY_MARGIN,
        metavar="REQUESTS",
        help="prefix-affinity: how many more requests than the least loaded engine the "
        "prefix's engine may hold and still get the request",
    )


def router_options(args: argparse.Namespace) -> list[str]:
    """The router flags in ``args``, as command-line options again."""
    return ["--router", args.router, "--router-affinity-margin", str(args.router_affinity_margin)]


def add_observability_args(parser: argparse._ActionsContainer) -> None:
    """Metrics and logs of a frontend."""
    parser.add_argument(
        "--disable-metrics",
        action="store_true",
        help="record no Prometheus metrics (GET /metrics answers 404)",
    )
    parser.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log a line when each generation request arrives (id, prompt lengths, sampling "
        "parameters) and one when it ends (finish reasons, tokens, TTFT, E2E)",
    )
    parser.add_argument(
        "--log-prompts",
        action="store_true",
        help="with --enable-log-requests: also log the start of each prompt (private data!)",
    )
    parser.add_argument(
        "--enable-access-log",
        action="store_true",
        help="uvicorn's access log: a line per HTTP request (method, path, status)",
    )


def observability_options(args: argparse.Namespace) -> list[str]:
    """The observability flags set in ``args``, as command-line options again."""
    names = ("disable_metrics", "enable_log_requests", "log_prompts", "enable_access_log")
    return [f"--{name.replace('_', '-')}" for name in names if getattr(args, name)]


def check_observability_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what would otherwise be ignored."""
    if args.log_prompts and not args.enable_log_requests:
        parser.error("--log-prompts needs --enable-log-requests (it adds prompts to those lines)")


def parse_args(
    argv: list[str] | None = None,
    prog: str = "conveyor frontend",
    description: str = __doc__.split("\n")[0],
) -> argparse.Namespace:
    parser = add_frontend_process_args(FlagParser(prog=prog, description=description))
    args = parser.parse_args(normalize_vllm_argv(sys.argv[1:] if argv is None else argv))
    check_observability_args(parser, args)
    try:
        args.http = http_options(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


def run(args: argparse.Namespace) -> int:
    configure_logging("frontend", args.log_level)
    tie_to_parent(args.parent_pid)
    if not args.disable_metrics:
        ensure_multiprocess_dir()
    # Imported only now: prometheus_client picks its (multiprocess) mode when it first loads.
    from conveyor.frontend.server.app import ServerSettings
    from conveyor.frontend.server.runner import listening_socket, run_server

    settings = ServerSettings(
        engine_addresses=tuple(args.engine),
        served_model_names=tuple(args.served_model_name or ()),
        api_keys=resolve_api_keys(args),
        max_queued_requests=args.max_queued_requests,
        max_request_body_bytes=args.max_request_body_bytes,
        engine_ready_timeout_s=args.engine_ready_timeout_s,
        engine_silence_timeout_s=args.engine_silence_timeout_s,
        engine_lost_timeout_s=args.engine_lost_timeout_s,
        enable_metrics=not args.disable_metrics,
        log_requests=args.enable_log_requests,
        log_prompts=args.log_prompts,
        router=args.router,
        router_affinity_margin=args.router_affinity_margin,
        http=args.http,
        responses_store=responses_store_limits(args),
        lora_modules=tuple(args.lora_modules or ()),
        allow_runtime_lora_updating=runtime_updates_allowed(args.allow_runtime_lora_updating),
    )
    for flag, why in flags_without_effect(args):
        logging.getLogger("conveyor.frontend").info("%s has no effect here: %s", flag, why)
    try:
        sock = listening_socket(args.host, args.port, args.listen_fd)
    except OSError as exc:
        logging.getLogger("conveyor.frontend").error(
            "cannot listen on %s:%d: %s", args.host, args.port, exc
        )
        return ExitCode.BAD_CONFIG
    return run_server(
        settings,
        sock,
        args.drain_timeout_s,
        args.ready_file,
        connection_limits(args),
        access_log=args.enable_access_log,
    )
