"""One HTTP connection, with deadlines and caps a slow or hostile client cannot get around.

Runs in an HTTP frontend process, on its event loop: uvicorn's httptools protocol, plus
  * a connection that sends nothing is closed after ``idle_timeout_s`` (uvicorn only times out
    the idle time between requests);
  * a request's headers must arrive within ``read_timeout_s`` of its first byte, and its body
    within ``read_timeout_s`` plus ``read_s_per_mib`` per MiB it declares (or, chunked, the most
    it may send) of the end of its headers; past that it gets 408 and the connection is closed,
    so a client trickling bytes holds nothing for long;
  * request headers are capped in bytes and in number: 431 at once, before they are buffered
    (httptools would otherwise collect a header of any size in memory).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger(__name__)

MIB = 1 << 20
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * MIB
_STATUS_TEXT = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


@dataclass(frozen=True)
class ConnectionLimits:
    idle_timeout_s: float = 5.0
    read_timeout_s: float = 10.0
    # 5 s per MiB: a client slower than 200 KiB/s cannot hold a connection for its body.
    read_s_per_mib: float = 5.0
    max_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_header_bytes: int = 64 << 10
    max_headers: int = 100


def guarded_protocol(limits: ConnectionLimits) -> type[HttpToolsProtocol]:
    """The protocol class uvicorn instantiates per connection, with ``limits``."""
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,), {"limits": limits})


class GuardedHttpProtocol(HttpToolsProtocol):
    limits = ConnectionLimits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # Bytes of the current request's head so far; None while its body is being read.
        self._header_bytes: int | None = 0
        self._num_headers = 0
        self._deadline: asyncio.TimerHandle | None = None
        self._arm(self.limits.idle_timeout_s, None)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        if self._header_bytes is not None:
            if self._header_bytes == 0:  # a request's first byte: its head has a deadline
                self._arm(self.limits.read_timeout_s, 408)
            self._header_bytes += len(data)
        super().data_received(data)
        # Still in the head after this read (which may also hold the start of the body): the
        # parser has buffered at most the cap and one read more.
        too_long = self._header_bytes is not None and (
            self._header_bytes > self.limits.max_header_bytes
        )
        if too_long and not self.transport.is_closing():
            self._refuse(431, "request headers over %d bytes", self.limits.max_header_bytes)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._num_headers += 1
        if self._num_headers <= self.limits.max_headers:
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._num_headers > self.limits.max_headers:
            # Not started: the request never reaches the app.
            self._refuse(431, "over %d request headers", self.limits.max_headers)
            return
        self._header_bytes = None
        self._num_headers = 0
        declared = _content_length(self.headers)
        body_bytes = self.limits.max_body_bytes if declared is None else declared
        budget = self.limits.read_timeout_s + self.limits.read_s_per_mib * body_bytes / MIB
        self._arm(budget, 408)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()  # the whole request is here; the response takes as long as it takes
        self._header_bytes = 0
        super().on_message_complete()

    # ------------------------------------------------------------------ deadlines

    def _arm(self, delay_s: float, status: int | None) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(delay_s, self._expire, status)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self, status: int | None) -> None:
        self._deadline = None
        if status is None:
            logger.debug("closing a connection that sent nothing")
            self.transport.close()
        else:
            self._refuse(status, "the request did not arrive in time")

    def _refuse(self, status: int, reason: str, *args: Any) -> None:
        """Answer ``status`` unless a response already began, and close the connection."""
        self._disarm()
        logger.info("closing a connection: " + reason, *args)
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if self._header_bytes is not None:  # in a request's head: any earlier cycle is done
            answer = cycle is None or cycle.response_complete
        else:  # in its body: ``cycle`` is this request's
            answer = cycle is not None and not cycle.response_started
        if answer:
            body = _STATUS_TEXT[status]
            self.transport.write(
                b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                % (status, _STATUS_TEXT[status], len(body), body)
            )
        if cycle is not None and not cycle.response_complete:
            # The app may be waiting for the rest of the body: it sees the client gone.
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length" and value.strip().isdigit():
            return int(value)
    return None
