"""How an HTTP frontend meets its clients: TLS, CORS, a root path behind a proxy, uvicorn's log
level and X-Request-Id headers, under vLLM's flag names.

Runs in the supervisor (``conveyor serve`` checks the flags, loads the certificate once so that
a bad one is refused before any model loads, and passes the flags on) and in each HTTP frontend
process (``python -m conveyor.frontend``), which builds uvicorn's TLS and logging settings and
the app's outer middleware from them. CORS is off unless a CORS flag is given (vLLM allows every
origin by default; a browser page on any site could then call a server on the user's machine).
"""

from __future__ import annotations

import argparse
import json
import ssl
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
REQUEST_ID_HEADER = "X-Request-Id"
# A client's own X-Request-Id is echoed back only up to this length.
_MAX_REQUEST_ID_CHARS = 256


@dataclass(frozen=True)
class TlsOptions:
    keyfile: str
    certfile: str
    ca_certs: str | None = None
    # ssl.CERT_NONE, CERT_OPTIONAL or CERT_REQUIRED: whether clients must show a certificate.
    cert_reqs: int = int(ssl.CERT_NONE)
    ciphers: str | None = None


@dataclass(frozen=True)
class CorsOptions:
    origins: tuple[str, ...] = ("*",)
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False


@dataclass(frozen=True)
class HttpOptions:
    tls: TlsOptions | None = None
    cors: CorsOptions | None = None
    # The path prefix a proxy strips before forwarding (ASGI's root_path).
    root_path: str = ""
    # None: uvicorn's loggers follow --log-level.
    uvicorn_log_level: str | None = None
    request_id_headers: bool = False

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"


def add_http_args(parser: argparse._ActionsContainer) -> None:
    """vLLM's TLS, CORS, root-path, uvicorn log level and request-id flags."""
    parser.add_argument("--ssl-keyfile", metavar="FILE", help="serve HTTPS with this private key")
    parser.add_argument("--ssl-certfile", metavar="FILE", help="... and this certificate (chain)")
    parser.add_argument(
        "--ssl-ca-certs", metavar="FILE", help="CA certificates to check client certificates by"
    )
    parser.add_argument(
        "--ssl-cert-reqs",
        type=int,
        choices=(0, 1, 2),
        default=int(ssl.CERT_NONE),
        help="client certificates: 0 none (default), 1 optional, 2 required (Python's ssl)",
    )
    parser.add_argument("--ssl-ciphers", help="OpenSSL cipher list for TLS 1.2 and below")
    for what in ("origins", "methods", "headers"):
        parser.add_argument(
            f"--allowed-{what}",
            type=_string_list,
            default=None,
            metavar="JSON",
            help=f"CORS: the allowed {what}, a JSON list ('[\"*\"]'; any CORS flag turns CORS "
            "on, the others then default to *)",
        )
    parser.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    parser.add_argument(
        "--root-path",
        default="",
        metavar="PATH",
        help="the path prefix a proxy strips before forwarding requests here",
    )
    parser.add_argument(
        "--uvicorn-log-level",
        choices=UVICORN_LOG_LEVELS,
        default=None,
        help="the HTTP server's own log level (default: --log-level's)",
    )
    parser.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help=f"send {REQUEST_ID_HEADER} with every response (the client's own, else a new one)",
    )


def _string_list(text: str) -> tuple[str, ...]:
    """A JSON list of strings, as vLLM takes these flags; a bare word is a list of one."""
    try:
        value = json.loads(text)
    except ValueError:
        value = text
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, got {text!r}")
    return tuple(value)


def http_options(args: argparse.Namespace) -> HttpOptions:
    """The options the flags in ``args`` set; raises ``ValueError`` naming what does not fit,
    or a certificate that does not load."""
    tls = None
    if args.ssl_keyfile or args.ssl_certfile:
        if not (args.ssl_keyfile and args.ssl_certfile):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together")
        tls = TlsOptions(
            args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs, args.ssl_cert_reqs,
            args.ssl_ciphers,
        )  # fmt: skip
        ssl_context(tls)
    elif args.ssl_ca_certs or args.ssl_ciphers or args.ssl_cert_reqs != ssl.CERT_NONE:
        raise ValueError("--ssl-ca-certs, --ssl-cert-reqs and --ssl-ciphers need --ssl-keyfile")
    cors = None
    lists = (args.allowed_origins, args.allowed_methods, args.allowed_headers)
    if args.allow_credentials or any(value is not None for value in lists):
        cors = CorsOptions(*(value or ("*",) for value in lists), args.allow_credentials)
    root_path = args.root_path.rstrip("/")
    if root_path and not root_path.startswith("/"):
        raise ValueError(f"--root-path must start with /, got {args.root_path!r}")
    return HttpOptions(tls, cors, root_path, args.uvicorn_log_level, args.enable_request_id_headers)


def ssl_context(tls: TlsOptions) -> ssl.SSLContext:
    """The server's TLS context, as uvicorn builds it; raises ``ValueError`` for files that
    do not load."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(tls.certfile, tls.keyfile)
        context.verify_mode = ssl.VerifyMode(tls.cert_reqs)
        if tls.ca_certs:
            context.load_verify_locations(tls.ca_certs)
        if tls.ciphers:
            context.set_ciphers(tls.ciphers)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"TLS (--ssl-keyfile {tls.keyfile}, --ssl-certfile ...): {exc}") from None
    return context


def http_flags(options: HttpOptions) -> list[str]:
    """``options`` as the command-line flags that make them again (for the frontends)."""
    flags: list[str] = []
    if options.tls is not None:
        tls = options.tls
        flags += ["--ssl-keyfile", tls.keyfile, "--ssl-certfile", tls.certfile]
        flags += ["--ssl-cert-reqs", str(tls.cert_reqs)]
        flags += ["--ssl-ca-certs", tls.ca_certs] if tls.ca_certs else []
        flags += ["--ssl-ciphers", tls.ciphers] if tls.ciphers else []
    if options.cors is not None:
        cors = options.cors
        for name, values in (
            ("origins", cors.origins), ("methods", cors.methods), ("headers", cors.headers)
        ):  # fmt: skip
            flags += [f"--allowed-{name}", json.dumps(list(values))]
        flags += ["--allow-credentials"] if cors.credentials else []
    flags += ["--root-path", options.root_path] if options.root_path else []
    if options.uvicorn_log_level is not None:
        flags += ["--uvicorn-log-level", options.uvicorn_log_level]
    flags += ["--enable-request-id-headers"] if options.request_id_headers else []
    return flags


def uvicorn_settings(options: HttpOptions) -> dict[str, Any]:
    """uvicorn.Config's keyword arguments for TLS, the root path and the log level."""
    settings: dict[str, Any] = {"root_path": options.root_path}
    if options.uvicorn_log_level is not None:
        settings["log_level"] = options.uvicorn_log_level
    if options.tls is not None:
        tls = options.tls
        settings.update(
            ssl_keyfile=tls.keyfile,
            ssl_certfile=tls.certfile,
            ssl_ca_certs=tls.ca_certs,
            ssl_cert_reqs=tls.cert_reqs,
        )
        if tls.ciphers:
            settings["ssl_ciphers"] = tls.ciphers
    return settings


def outer_middleware(options: HttpOptions) -> list[Middleware]:
    """What wraps the gate: CORS first (a preflight is answered before any API key check), then
    the request-id header."""
    middleware = []
    if options.cors is not None:
        cors = options.cors
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(cors.origins),
                allow_methods=list(cors.methods),
                allow_headers=list(cors.headers),
                allow_credentials=cors.credentials,
            )
        )
    if options.request_id_headers:
        middleware.append(Middleware(RequestIdMiddleware))
    return middleware


class RequestIdMiddleware:
    """Every response carries X-Request-Id: the request's own (bounded), else a new one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex
        for name, value in scope["headers"]:
            if name == b"x-request-id" and 0 < len(value) <= _MAX_REQUEST_ID_CHARS:
                request_id = value.decode("latin-1")
        header = (REQUEST_ID_HEADER.lower().encode(), request_id.encode("latin-1"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), header]
            await send(message)

        await self.app(scope, receive, send_with_id)
