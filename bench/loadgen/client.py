"""One streaming request to an OpenAI-compatible server, timed chunk by chunk.

Runs in the load generator's process (conveyor bench serve), on its asyncio loop. A request is
sent with ``stream: true`` and ``stream_options.include_usage``; every server-sent event carrying
content (completion text, chat content or reasoning) is one content chunk. TTFT is the time to
the first content chunk, each later gap is one inter-token latency, E2E latency is the time to the
last content chunk (as in ``vllm bench serve``: the usage chunk and ``[DONE]`` that follow carry
no token), and the output token count is the usage chunk's ``completion_tokens`` where the server
sends one, else the number of chunks. A stream that cannot be read (an error event, a chunk that
is not a JSON object of the OpenAI shape, no ``[DONE]``) fails the request with that reason.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from conveyor.bench.loadgen.datasets import SampleRequest

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
_MAX_REASON_CHARS = 200
_DRAIN_TIMEOUT_S = 5.0  # a server that keeps the body open after [DONE]
_JSON_TYPES = {
    list: "array",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
    type(None): "null",
}
_USAGE_COUNTS = ("completion_tokens", "prompt_tokens")


@dataclass
class RequestOutput:
    """What one request measured. Times are seconds; ``start_time`` is time.perf_counter()."""

    prompt_len: int
    expected_output_len: int
    success: bool = False
    cancelled: bool = False  # the client dropped it on purpose (--cancel-rate)
    error: str = ""
    output_tokens: int = 0
    num_chunks: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    queue_time: float = 0.0  # scheduled arrival -> sent (waiting for a --max-concurrency slot)


@dataclass(frozen=True)
class Endpoint:
    """Where and how to send: the URL, headers and the request body's fixed fields."""

    base_url: str
    model: str
    kind: str = "completions"  # or "chat"
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ENDPOINT_PATHS[self.kind]

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def body(self, sample: SampleRequest) -> bytes:
        body: dict[str, Any] = {
            "model": self.model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": sample.ignore_eos,
        }
        if self.kind == "chat":
            body["messages"] = [{"role": "user", "content": sample.prompt}]
            body["max_completion_tokens"] = sample.output_len
        else:
            body["prompt"] = sample.prompt
            body["max_tokens"] = sample.output_len
        body.update(self.extra_body)
        return msgspec.json.encode(body)


class StreamState:
    """Parses server-sent events as bytes arrive and times the content chunks."""

    def __init__(self, out: RequestOutput, cancel_after: int | None) -> None:
        self.out = out
        self.cancel_after = cancel_after
        self.buffer = b""
        self.last_time = 0.0
        self.done_time: float | None = None  # when [DONE] arrived
        self.usage_tokens: int | None = None
        self.usage_prompt_tokens: int | None = None

    def feed(self, data: bytes, now: float) -> bool:
        """Consume bytes; True when the stream is over (done, failed, or to be dropped).

        Every event in one read gets that read's time: that is when the client saw them.
        """
        # One split per read, not one slice per event: a busy client reads dozens at once.
        events = (self.buffer + data).replace(b"\r\n", b"\n").split(b"\n\n")
        self.buffer = events.pop()  # an incomplete event, or b""
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:") and self._on_data(line[5:].strip(), now):
                    return True
        return False

    def _on_data(self, payload: bytes, now: float) -> bool:
        if payload == b"[DONE]":
            self.done_time = now
            return True
        chunk = msgspec.json.decode(payload)
        if reason := _shape_error(chunk):
            # Valid JSON of the wrong shape: without this check ``chunk.get`` or the loops below
            # raise outside send_request's handlers and take the whole run down.
            excerpt = payload[:80].decode(errors="replace")
            self.out.error = f"malformed stream chunk ({reason}): {excerpt}"[:_MAX_REASON_CHARS]
            return True
        if "error" in chunk:
            self.out.error = "stream error: " + _error_message(chunk)[:_MAX_REASON_CHARS]
            return True
        usage = chunk.get("usage")
        if usage:
            self.usage_tokens = usage.get("completion_tokens")
            self.usage_prompt_tokens = usage.get("prompt_tokens")
        for choice in chunk.get("choices") or ():
            if _content(choice):
                return self._on_content(now)
        return False

    def _on_content(self, now: float) -> bool:
        out = self.out
        if out.num_chunks == 0:
            out.ttft = now - out.start_time
        else:
            out.itl.append(now - self.last_time)
        self.last_time = now
        out.num_chunks += 1
        if self.cancel_after is not None and out.num_chunks >= self.cancel_after:
            out.cancelled = True
            return True
        return False


def _shape_error(chunk: Any) -> str | None:
    """Why ``chunk`` is not a streamed completion or chat chunk, or None when it is one."""
    if not isinstance(chunk, dict):
        return f"a JSON {_JSON_TYPES.get(type(chunk), 'value')}, not an object"
    usage = chunk.get("usage") or {}
    if not isinstance(usage, dict):
        return "usage is not an object"
    if any(not isinstance(usage.get(key) or 0, int) for key in _USAGE_COUNTS):
        return "usage token counts are not integers"
    choices = chunk.get("choices") or []
    if not isinstance(choices, list):
        return "choices is not a list"
    for choice in choices:
        if not isinstance(choice, dict) or not isinstance(choice.get("delta") or {}, dict):
            return "a choice or its delta is not an object"
    return None


def _content(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return choice["text"] or ""
    delta = choice.get("delta") or {}
    return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""


def _error_message(body: Any) -> str:
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict):
            return str(error.get("message") or error)
        return str(error)
    return str(body)


async def send_request(
    session: aiohttp.ClientSession,
    endpoint: Endpoint,
    sample: SampleRequest,
    cancel_after: int | None = None,
) -> RequestOutput:
    """Send one streaming request; never raises except for cancellation of the caller."""
    out = RequestOutput(sample.prompt_len, sample.output_len)
    out.start_time = time.perf_counter()
    try:
        async with session.post(
            endpoint.url, data=endpoint.body(sample), headers=endpoint.headers()
        ) as response:
            if response.status != 200:
                out.error = await _http_error(response)
            elif cancel_after == 0:
                out.cancelled = True
                response.close()
            else:
                await _read_stream(response, out, StreamState(out, cancel_after))
    except asyncio.TimeoutError:
        out.error = "TimeoutError"
    except (aiohttp.ClientError, OSError, msgspec.DecodeError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:_MAX_REASON_CHARS]
    if not out.success:
        out.latency = time.perf_counter() - out.start_time
    return out


async def _read_stream(
    response: aiohttp.ClientResponse, out: RequestOutput, state: StreamState
) -> None:
    async for data in response.content.iter_any():
        if state.feed(data, time.perf_counter()):
            break
    if state.done_time is not None and not response.content.at_eof():
        # Read the end of the body (the last chunk marker) so the connection goes back to the
        # pool; an unfinished body closes it and the next request pays a new connection.
        try:
            await asyncio.wait_for(response.content.read(), _DRAIN_TIMEOUT_S)
        except asyncio.TimeoutError:
            response.close()
    if out.cancelled:
        # Closing (not releasing) drops the connection, which is how the server sees the
        # client go away; a released connection would be drained or reused.
        response.close()
        out.output_tokens = out.num_chunks
        return
    if out.error:
        return
    if state.done_time is None:
        out.error = "stream ended without [DONE]"
        return
    out.success = True
    out.output_tokens = state.usage_tokens if state.usage_tokens is not None else out.num_chunks
    if state.usage_prompt_tokens is not None:
        out.prompt_len = state.usage_prompt_tokens
    if out.num_chunks == 0:
        # Nothing streamed: the whole (empty) answer arrived with [DONE].
        out.latency = out.ttft = state.done_time - out.start_time
    else:
        out.latency = state.last_time - out.start_time


async def _http_error(response: aiohttp.ClientResponse) -> str:
    text = await response.text(errors="replace")
    try:
        message = _error_message(msgspec.json.decode(text))
    except msgspec.DecodeError:
        message = text.strip()
    return f"HTTP {response.status}: {message}"[:_MAX_REASON_CHARS]
