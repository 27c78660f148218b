"""``conveyor serve [MODEL]``: the supervisor. Start the engine core (which starts its workers) and
the HTTP frontends; watch them.

    conveyor serve [MODEL] [--frontends N] [--port 8000] [engine args...]

Runs as the supervisor process, the parent of every conveyor process. It prints
``ready: engine_core pid=PID address=ADDRESS`` once the engine answers clients at ADDRESS (attach
with ``MPEngineClient(address=...)``, ``AsyncEngineClient.start(address=...)`` or
``conveyor frontend --engine ADDRESS``), then starts N OpenAI-compatible HTTP frontends sharing
one port and prints ``ready: http://HOST:PORT`` once each of them serves. Then it watches its
children: a dead frontend is restarted (it holds no state; the engine aborts its requests when its
heartbeat stops), unless frontends died more than --frontend-max-restarts times within
--frontend-restart-window-s; the engine core's death, or a spent restart budget, stops everything
and exits 1. With ``--data-parallel-size N`` it runs N engine cores (``engine_core-0`` ...,
one ready line each; every frontend is a client of all of them and routes each request,
--router), and a dead one is restarted in place (--engine-max-restarts within
--engine-restart-window-s) while the others serve; with ``--data-parallel-size-local`` below
it, the other ranks run on other hosts (``--headless --data-parallel-start-rank R`` there, which
runs engines only) and the frontends start once those have announced themselves (``launch``,
``dp_hosts``). SIGTERM or SIGINT stops all of them
gracefully (frontends drain first, for up to --drain-timeout-s; SIGTERM, then SIGKILL after
--stop-timeout-s) and exits 0. Children watch their parent, so even a SIGKILLed supervisor leaves
no orphans. MODEL (or ``--model``) is a local
Hugging Face model directory or an id (from the Hugging Face cache, else downloaded from the
Hub once, before anything starts); without one it serves the embedded default model.
``--frontends 0`` runs the engine alone.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import urllib.error
import urllib.request
from pathlib import Path

from conveyor.entrypoints.headless import add_multi_host_args, check_host_addresses, run_headless
from conveyor.entrypoints.launch import serve_host, start_frontends
from conveyor.entrypoints.serve_config import FrontendsConfig, ServeConfig
from conveyor.entrypoints.supervisor import base_url, urlopen_local
from conveyor.executor.backends import EXECUTOR_BACKENDS
from conveyor.frontend.engine_args import (
    DEFAULT_SERVED_MODEL_NAME,
    add_engine_args,
)
from conveyor.frontend.engine_client.session import DEFAULT_READY_TIMEOUT_S, HEARTBEAT_INTERVAL_S
from conveyor.frontend.server.http_options import add_http_args, http_options
from conveyor.frontend.server.lora_modules import add_lora_module_args, runtime_updates_allowed
from conveyor.frontend.server.main import (
    add_api_key_args,
    add_connection_args,
    add_drain_args,
    add_engine_session_args,
    add_observability_args,
    add_responses_store_args,
    add_router_args,
    add_served_model_name_arg,
    check_observability_args,
    observability_options,
)
from conveyor.frontend.vllm_flags import (
    SERVER_FLAGS,
    FlagParser,
    add_vllm_flags,
    flags_without_effect,
    normalize_vllm_argv,
)
from conveyor.protocol import ConfigError
from conveyor.runtime.exit_codes import ExitCode
from conveyor.runtime.flags import non_negative_float, positive_float
from conveyor.runtime.listen import ListeningSockets
from conveyor.runtime.logs import LOG_LEVEL_ENV, configure_logging
from conveyor.runtime.processes import ChildProcess
from conveyor.runtime.signals import ShutdownRequested, install_shutdown_signals
from conveyor.runtime.zmq_security import CURVE_KEYS_ENV, CurveKeysError, InsecureAddressError

logger = logging.getLogger("conveyor.serve")

DEMO_MAX_TOKENS = 48


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = FlagParser(
        prog="conveyor serve",
        description="Serve a model over an OpenAI-compatible HTTP API: the engine core, its "
        "workers and N HTTP frontends, supervised. vLLM's serve flags are taken as vLLM spells "
        "them (docs/serving.md#vllm-flags).",
    )
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="a local Hugging Face model directory or an id (org/name): from the Hugging Face "
        "cache, else downloaded from the Hub (same as --model; default: the embedded model)",
    )
    parser.add_argument(
        "--address",
        default=None,
        help="where the engine listens: ipc://PATH (default: a private folder) or "
        "tcp://127.0.0.1:PORT; another host only with --allow-remote-clients and --curve-keys",
    )
    parser.add_argument(
        "--allow-remote-clients",
        action="store_true",
        help="let the engine bind a tcp address other hosts can reach (needs --curve-keys)",
    )
    parser.add_argument(
        "--executor-backend",
        "--distributed-executor-backend",
        type=_executor_backend,
        metavar="{" + ",".join(EXECUTOR_BACKENDS) + "}",
        help="mp: a process per tensor-parallel rank (default); inprocess (vLLM's uni): one "
        "worker inside the engine process; ray: Ray actors",
    )
    parser.add_argument(
        "--config",
        metavar="YAML",
        help="read flags from a YAML file of flag: value (the command line wins), as vLLM does",
    )
    parser.add_argument(
        "--engine-max-restarts",
        type=int,
        default=5,
        help="with --data-parallel-size > 1: restart a dead engine at most this often within "
        "--engine-restart-window-s (the others serve meanwhile); one more death stops "
        "everything. With one engine, its death always stops everything",
    )
    parser.add_argument("--engine-restart-window-s", type=positive_float, default=60.0)
    parser.add_argument("--heartbeat-timeout-s", type=positive_float, default=None)
    parser.add_argument("--ready-timeout-s", type=positive_float, default=DEFAULT_READY_TIMEOUT_S)
    parser.add_argument("--stop-timeout-s", type=non_negative_float, default=10.0)
    parser.add_argument(
        "--log-level", default=None, help="every process's log level (default: INFO)"
    )
    add_frontend_args(parser)
    add_multi_host_args(parser)
    add_engine_args(parser)
    args = parser.parse_args(read_vllm_command_line(parser, argv))
    try:
        args.http = http_options(args)
    except ValueError as exc:
        parser.error(str(exc))
    if None not in (args.model_tag, args.model) and args.model != args.model_tag:
        parser.error(f"MODEL {args.model_tag!r} and --model {args.model!r} disagree")
    if args.frontends < 0:
        parser.error(f"--frontends must be >= 0, got {args.frontends}")
    if (
        args.heartbeat_timeout_s is not None
        and args.heartbeat_timeout_s < 1.5 * HEARTBEAT_INTERVAL_S
    ):
        # Below that, a healthy idle client (a frontend) would be dropped between two heartbeats.
        parser.error(
            f"--heartbeat-timeout-s must be at least {1.5 * HEARTBEAT_INTERVAL_S:g} (clients "
            f"heartbeat every {HEARTBEAT_INTERVAL_S:g} s), got {args.heartbeat_timeout_s:g}"
        )
    if args.frontend_max_restarts < 0 or args.drain_timeout_s < 0:
        parser.error("--frontend-max-restarts and --drain-timeout-s must be >= 0")
    if args.engine_max_restarts < 0:
        parser.error(f"--engine-max-restarts must be >= 0, got {args.engine_max_restarts}")
    for name in ("max_queued_requests", "max_request_body_bytes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    check_observability_args(parser, args)
    if args.lora_modules and not args.enable_lora:
        parser.error("--lora-modules: adapters are served only with --enable-lora")
    if runtime_updates_allowed(args.allow_runtime_lora_updating) and args.frontends > 1:
        # Each frontend keeps its own list of adapters: a load on one is unknown to the rest.
        parser.error("run-time LoRA updating works with one frontend (--api-server-count 1)")
    set_frontend_flags = [f for f in observability_options(args) if f != "--disable-metrics"]
    if not args.frontends and set_frontend_flags:
        parser.error(f"{' '.join(set_frontend_flags)}: there are no frontends (--frontends 0)")
    if args.frontends and not 0 < args.port < 65536:
        # Port 0 would give every frontend its own random port: they must share one.
        parser.error(f"--port must be in [1, 65535], got {args.port}")
    return args


def _executor_backend(text: str) -> str:
    name = {"uni": "inprocess"}.get(text, text)
    if name not in EXECUTOR_BACKENDS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: conveyor runs {', '.join(EXECUTOR_BACKENDS)} (uni is inprocess)"
        )
    return name


def read_vllm_command_line(parser: argparse.ArgumentParser, argv: list[str] | None) -> list[str]:
    """The command line as vLLM's parser reads it: ``--max_model_len`` for ``--max-model-len``,
    and ``--config FILE``'s flags in front of the others (which therefore win); a leading MODEL
    stays first."""
    argv = normalize_vllm_argv(sys.argv[1:] if argv is None else argv)
    for i, arg in enumerate(argv):
        if arg == "--config" or arg.startswith("--config="):
            path = arg.partition("=")[2] or (argv[i + 1] if i + 1 < len(argv) else "")
            rest = argv[:i] + argv[i + (1 if "=" in arg else 2) :]
            model = rest[:1] if rest and not rest[0].startswith("-") else []
            return model + config_file_flags(parser, path) + rest[len(model) :]
    return argv


def config_file_flags(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """The flags a YAML file of ``flag: value`` means (vLLM's ``--config``): ``true`` for a
    switch, a list for several values, a mapping as JSON."""
    try:
        import yaml

        with open(path) as file:
            values = yaml.safe_load(file) or {}
    except ImportError:
        parser.error("--config needs PyYAML (pip install pyyaml)")
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"--config {path}: {exc}")
    if not isinstance(values, dict):
        parser.error(f"--config {path}: not a mapping of flag: value")
    flags: list[str] = []
    for key, value in values.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            flags += [flag, *(str(item) for item in value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def add_frontend_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("HTTP frontends")
    group.add_argument(
        "--frontends",
        "--api-server-count",
        "-asc",
        type=int,
        default=1,
        help="HTTP frontend processes (0: none)",
    )
    group.add_argument("--host", default="127.0.0.1", help="interface the frontends listen on")
    group.add_argument("--port", type=int, default=8000, help="the port every frontend shares")
    add_api_key_args(group)
    group.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="per frontend: 429 while this many generation requests are in flight",
    )
    add_served_model_name_arg(group, f"MODEL, or {DEFAULT_SERVED_MODEL_NAME}")
    add_lora_module_args(group)
    group.add_argument("--max-request-body-bytes", type=int, default=None)
    add_router_args(group)
    add_connection_args(group)
    group.add_argument("--frontend-ready-timeout-s", type=positive_float, default=60.0)
    add_engine_session_args(group)
    add_drain_args(group)
    group.add_argument(
        "--frontend-max-restarts",
        type=int,
        default=5,
        help="restart a dead frontend at most this often within --frontend-restart-window-s; "
        "one more death stops everything (0: any frontend death stops everything)",
    )
    group.add_argument("--frontend-restart-window-s", type=positive_float, default=60.0)
    add_observability_args(group)
    add_responses_store_args(group)
    add_http_args(group)
    add_vllm_flags(group, SERVER_FLAGS)
    group.add_argument(
        "--demo-prompt",
        default=None,
        metavar="TEXT",
        help="once serving, send this prompt through the HTTP API, print the completion and "
        "a curl command, then go on serving",
    )


def serve(config: ServeConfig) -> int:
    frontends = config.frontends
    listening = None
    if frontends.count and not config.hosts.headless:  # a headless host runs engines only
        # Bound before any engine starts: a port another process holds is refused now, not
        # after the model has loaded. Clients that connect meanwhile wait in the listen queue.
        try:
            listening = ListeningSockets(frontends.host, frontends.port, frontends.count)
        except OSError as exc:
            logger.error("cannot listen on %s:%d: %s", frontends.host, frontends.port, exc)
            return ExitCode.BAD_CONFIG

    def on_serving(
        addresses: list[str], runtime_dir: Path, children: dict[str, ChildProcess]
    ) -> None:
        # Frontends start only now, so they never talk to an engine still loading.
        if listening is not None:
            start_frontends(frontends, addresses, runtime_dir, children, listening)
            scheme = frontends.http.scheme
            print(f"ready: {scheme}://{frontends.host}:{frontends.port}", flush=True)
            if frontends.demo_prompt is not None:
                show_completion(frontends, frontends.demo_prompt)

    try:
        return serve_host(config, on_serving, listening)
    finally:
        if listening is not None:
            listening.close()


def demo_body(served_model_name: str, prompt: str) -> dict[str, object]:
    """A greedy completion request; the server adds the model's own defaults for the rest (the
    embedded model's repetition penalty: greedy decoding of a small model loops)."""
    body: dict[str, object] = {"model": served_model_name, "prompt": prompt}
    body.update(max_tokens=DEMO_MAX_TOKENS, temperature=0)
    return body


def show_completion(frontends: FrontendsConfig, prompt: str) -> None:
    """One greedy completion through our own HTTP API: proof that the whole path serves."""
    url = f"{base_url(frontends.host, frontends.port, frontends.http.scheme)}/v1/completions"
    body = demo_body(frontends.served_model_name, prompt)
    headers = {"Content-Type": "application/json"}
    if frontends.api_keys:
        headers["Authorization"] = f"Bearer {frontends.api_keys[0]}"
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urlopen_local(request, timeout_s=60.0) as response:
            result = json.load(response)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        # The demo is a courtesy: a failure is reported, the server keeps serving.
        logger.error("the demo completion failed: %s", exc)
        return
    choice = result["choices"][0]
    print(f"completion ({choice['finish_reason']}):\n{prompt}{choice['text']}\n", flush=True)
    curl_body = json.dumps(body)
    print(
        f"try: curl {url} -H 'Content-Type: application/json' -d {shlex.quote(curl_body)}\n"
        "serving until Ctrl-C",
        flush=True,
    )


def export_to_children(config: ServeConfig) -> None:
    """What every process started from here reads from the environment it inherits."""
    if config.log_level:
        os.environ[LOG_LEVEL_ENV] = config.log_level
    if config.hosts.curve_keys_dir:
        # By path: every process started from here finds the same keys.
        os.environ[CURVE_KEYS_ENV] = config.hosts.curve_keys_dir


def main(argv: list[str] | None = None) -> int:
    # Installed before anything starts, so no signal can leave a half-started child behind.
    install_shutdown_signals()
    try:
        args = parse_args(argv)
        configure_logging("serve", args.log_level)
        for flag, why in flags_without_effect(args):
            logger.info("%s has no effect here: %s", flag, why)
        try:
            config = ServeConfig.from_args(args)
            export_to_children(config)
            check_host_addresses(config)
        except (ConfigError, CurveKeysError, InsecureAddressError) as exc:
            logger.error("%s", exc)
            return ExitCode.BAD_CONFIG
        # --headless with --nnodes: tensor-parallel ranks; without: data-parallel engines.
        return run_headless(config) if config.runs_tensor_parallel_ranks_only else serve(config)
    except ShutdownRequested:
        return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
