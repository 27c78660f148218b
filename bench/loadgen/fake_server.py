"""A fake OpenAI-compatible server that streams exactly what it is told to, for the load generator.

Runs in its own process (``python -m benchmarks fake-server --port 0`` prints ``PORT=<n>``)
or on a test's event loop. POST /v1/completions and /v1/chat/completions stream ``max_tokens``
(or ``max_completion_tokens``) chunks as server-sent events: the first after ``ttft_ms``, each
next one ``itl_ms`` later, or ``slow_itl_ms`` while more than ``slow_above`` streams are active (a
server whose inter-token latency grows with load, for the capacity search). With ``max_running``
only that many streams generate at once and the rest wait for a slot before their first token (a
server that queues: TTFT grows with load while ITL does not). A usage chunk follows
when the request asks for ``stream_options.include_usage``, then ``data: [DONE]``. Every
``fail_every``-th request answers ``fail_status`` instead, requests over ``max_tokens_limit`` get
a 400, and a wrong ``Authorization: Bearer`` key (when ``api_key`` is set) a 401. The stats count requests, completions, failures and clients that hung up mid-stream.

The process exits by itself when its parent (or ``--parent-pid``) dies or after ``--max-lifetime-s``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec
from aiohttp import web


@dataclass(frozen=True)
class FakeServerConfig:
    ttft_ms: float = 0.0
    itl_ms: float = 0.0
    slow_itl_ms: float = 0.0
    slow_above: int = 0  # 0: never slow
    max_running: int = 0  # 0: no limit; N: streams beyond N wait for a slot (queueing)
    fail_every: int = 0  # 0: never fail; N: requests N, 2N, ... fail
    fail_status: int = 500
    max_tokens_limit: int = 1 << 20
    usage: bool = True  # honour stream_options.include_usage
    api_key: str | None = None  # when set, other Authorization headers get a 401
    model: str = "fake-model"


@dataclass
class FakeServerStats:
    num_requests: int = 0
    num_completed: int = 0
    num_failed: int = 0
    num_disconnected: int = 0  # clients that closed the stream before [DONE]
    num_active: int = 0
    max_active: int = 0
    bodies: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=4096))


class FakeServer:
    """The aiohttp application and its counters."""

    def __init__(self, config: FakeServerConfig) -> None:
        self.config = config
        self.stats = FakeServerStats()
        self._runner: web.AppRunner | None = None
        self._slots: asyncio.Semaphore | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen; returns the port (pick one with 0)."""
        if self.config.max_running:
            self._slots = asyncio.Semaphore(self.config.max_running)
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/stats", self._stats)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        return int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.config.model}]})

    async def _stats(self, request: web.Request) -> web.Response:
        stats = asdict(self.stats)
        del stats["bodies"]
        return web.json_response(stats)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        stats, config = self.stats, self.config
        stats.num_requests += 1
        body = msgspec.json.decode(await request.read())
        stats.bodies.append(body)
        num_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        if config.api_key and request.headers.get("Authorization") != f"Bearer {config.api_key}":
            return _error(stats, 401, "invalid API key")
        if config.fail_every and stats.num_requests % config.fail_every == 0:
            return _error(stats, config.fail_status, "injected failure")
        if num_tokens > config.max_tokens_limit:
            return _error(stats, 400, "max_tokens exceeds the fake server's limit")
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        stats.num_active += 1
        stats.max_active = max(stats.max_active, stats.num_active)
        try:
            await response.prepare(request)
            await self._stream(response, body, num_tokens, chat)
            stats.num_completed += 1
        except ConnectionError:
            stats.num_disconnected += 1
        finally:
            stats.num_active -= 1
        return response

    async def _stream(
        self, response: web.StreamResponse, body: dict[str, Any], num_tokens: int, chat: bool
    ) -> None:
        chunks = _Chunks(self.stats.num_requests, self.config.model, chat)
        if chat:
            await response.write(chunks.role())
        async with self._slots or contextlib.nullcontext():
            for index in range(num_tokens):
                await self._wait(self.config.ttft_ms if index == 0 else self._itl_ms())
                await response.write(chunks.token(last=index == num_tokens - 1))
        if self.config.usage and (body.get("stream_options") or {}).get("include_usage"):
            await response.write(chunks.usage(_prompt_tokens(body), num_tokens))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()

    def _itl_ms(self) -> float:
        config = self.config
        if config.slow_above and self.stats.num_active > config.slow_above:
            return config.slow_itl_ms
        return config.itl_ms

    @staticmethod
    async def _wait(delay_ms: float) -> None:
        # Zero delay still yields, so each token is its own write as in a real server where
        # tokens come one engine step apart, and streams interleave.
        await asyncio.sleep(delay_ms / 1000.0)


class _Chunks:
    """The SSE events of one stream, encoded once: every token event is the same bytes."""

    def __init__(self, number: int, model: str, chat: bool) -> None:
        self.chat = chat
        self.head: dict[str, Any] = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{number}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 0,
            "model": model,
        }
        self._token = self._event(self._choice(" tok", None))
        self._last = self._event(self._choice(" tok", "length"))

    def _choice(self, text: str, finish: str | None) -> dict[str, Any]:
        if self.chat:
            return {"index": 0, "delta": {"content": text}, "finish_reason": finish}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    def _event(self, *choices: dict[str, Any], **extra: Any) -> bytes:
        return (
            b"data: "
            + msgspec.json.encode({**self.head, "choices": list(choices), **extra})
            + b"\n\n"
        )

    def role(self) -> bytes:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        return self._event(choice)

    def token(self, last: bool) -> bytes:
        return self._last if last else self._token

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        return self._event(usage=usage)


def _prompt_tokens(body: dict[str, Any]) -> int:
    """Token ids count as sent; text counts one token per word (the loadgen's word prompts)."""
    prompt = body.get("prompt")
    if prompt is None:
        prompt = " ".join(str(m.get("content") or "") for m in body.get("messages") or ())
    if isinstance(prompt, list):
        return len(prompt)
    return len(str(prompt).split())


def _error(stats: FakeServerStats, status: int, message: str) -> web.Response:
    stats.num_failed += 1
    error = {"message": message, "type": "BadRequestError" if status < 500 else "InternalError"}
    return web.json_response({"error": {**error, "code": status}}, status=status)


async def serve(config: FakeServerConfig, port: int, parent: int, max_lifetime_s: float) -> None:
    """Run until the ``parent`` process goes away or the lifetime is up."""
    server = FakeServer(config)
    bound = await server.start(port=port)
    print(f"PORT={bound}", flush=True)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max_lifetime_s
    try:
        while os.getppid() == parent and loop.time() < deadline:
            await asyncio.sleep(0.5)
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> int:
    # Read first: a parent that exits as soon as it has the port must still be noticed.
    parent = os.getppid()
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks fake-server", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ttft-ms", type=float, default=0.0)
    parser.add_argument("--itl-ms", type=float, default=0.0)
    parser.add_argument("--slow-itl-ms", type=float, default=0.0)
    parser.add_argument("--slow-above", type=int, default=0)
    parser.add_argument("--max-running", type=int, default=0, help="0: no queueing")
    parser.add_argument("--fail-every", type=int, default=0)
    parser.add_argument("--fail-status", type=int, default=500)
    parser.add_argument("--max-lifetime-s", type=float, default=3600.0)
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when it is gone")
    args = parser.parse_args(argv)
    parent = args.parent_pid or parent
    config = FakeServerConfig(
        ttft_ms=args.ttft_ms,
        itl_ms=args.itl_ms,
        slow_itl_ms=args.slow_itl_ms,
        slow_above=args.slow_above,
        max_running=args.max_running,
        fail_every=args.fail_every,
        fail_status=args.fail_status,
    )
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    run(serve(config, args.port, parent, args.max_lifetime_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
