"""How many API connections the server holds, how long one may wait before its request, and a log that
cannot flood when accepting fails.

uvicorn closes a connection that idles after a response (its keep-alive timeout), but not one that never
sends a request: a thousand such sockets hold as many file descriptors, and once the process runs out,
accept() fails, the API stops answering and asyncio logs the failure on every retry. Here a connection
must send its whole request head within read_header_timeout_seconds, and the connections held are
bounded by max_connections and by half the process's file descriptors (the rest are for the agents,
the store and the peers). A new connection beyond the bound takes the place of the oldest one still
waiting for its request; with none waiting (every one is being answered) it is closed at once.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any, Callable

import orjson
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

DEFAULT_READ_HEADER_TIMEOUT_SECONDS = 5.0


def descriptor_budget() -> int:
    """Connections the process's open-file limit leaves room for: half of it."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(soft // 2, 8) if soft != resource.RLIM_INFINITY else 1 << 20


def raise_descriptor_limit() -> int:
    """Raise the soft open-file limit to the hard one (as Go daemons do at start); returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def bounded_protocol(
    max_connections: int,
    read_header_timeout_seconds: float = DEFAULT_READ_HEADER_TIMEOUT_SECONDS,
    budget: Callable[[], int] = descriptor_budget,
) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the bounds above; one class per server (it keeps that server's queue of
    connections waiting for their request)."""
    waiting: dict[BoundedH11Protocol, None] = {}  # oldest first

    class BoundedH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _armed_cycle: Any = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            room = min(max_connections, budget())
            open_ = sum(1 for c in self.connections if not c.transport.is_closing())
            while open_ > room and waiting:
                victim = next(iter(waiting))
                victim._close("connection limit")
                open_ -= 1
            if open_ > room:
                self._close("connection limit")
                return
            self._await_request()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not self._armed_cycle:
                self._request_started()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._await_request()

        def connection_lost(self, exc: Exception | None) -> None:
            self._request_started()
            super().connection_lost(exc)

        def _await_request(self) -> None:
            """Start the clock for the next request's head."""
            self._request_started()
            waiting[self] = None
            self._armed_cycle = self.cycle
            self._deadline = self.loop.call_later(read_header_timeout_seconds, self._close, "no request in time")

        def _request_started(self) -> None:
            waiting.pop(self, None)
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _close(self, why: str) -> None:
            self._request_started()
            if not self.transport.is_closing():
                log.debug("connection closed", extra={"reason": why, "client": (self.client or ("",))[0]})
                self.transport.close()

    return BoundedH11Protocol


class AnswerLimit:
    """ASGI middleware: at most `limit` answers under `prefix` in progress at once. A file answer holds up to
    uvicorn's write buffer until its client has read it, so a thousand slow readers of the /docs files would
    hold a thousand of those; beyond the limit a request waits up to `wait_seconds` for a slot, then is
    answered 503 with Retry-After."""

    def __init__(self, app: Any, prefix: str, limit: int, wait_seconds: float) -> None:
        self.app = app
        self.prefix = prefix
        self.limit = limit
        self.wait_seconds = wait_seconds
        self.refused = 0
        self._slots: asyncio.Semaphore | None = None  # made on the server's loop, at the first request

    async def __call__(self, scope: dict, receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.limit)
        try:
            async with asyncio.timeout(self.wait_seconds):
                await self._slots.acquire()
        except TimeoutError:
            self.refused += 1
            await _busy(send, f"at most {self.limit} {self.prefix} answers at once; retry")
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self._slots.release()


async def _busy(send: Callable[..., Any], message: str) -> None:
    body = orjson.dumps({"error": "busy", "message": message})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 503, "headers": [*headers, (b"retry-after", b"1")]})
    await send({"type": "http.response.body", "body": body})


class OncePerInterval(logging.Filter):
    """Lets through one matching record per interval; the next one says how many were held back
    (`repeated`). asyncio logs a failing accept() on every retry: without this, hundreds of thousands
    of lines a minute while the process is out of file descriptors."""

    def __init__(
        self,
        match: Callable[[logging.LogRecord], bool],
        interval_seconds: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self._match = match
        self._interval = interval_seconds
        self._clock = clock
        self._last: float | None = None
        self._held = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not self._match(record):
            return True
        now = self._clock()
        if self._last is not None and now - self._last < self._interval:
            self._held += 1
            return False
        self._last = now
        record.repeated = self._held
        self._held = 0
        return True


def is_accept_error(record: logging.LogRecord) -> bool:
    """asyncio's record of accept() failing for want of file descriptors or memory."""
    return record.name == "asyncio" and str(record.msg).startswith("socket.accept() out of system resource")


def limit_accept_error_logs(interval_seconds: float = 10.0) -> OncePerInterval:
    """Install OncePerInterval for accept errors on asyncio's logger; returns it."""
    flt = OncePerInterval(is_accept_error, interval_seconds)
    logging.getLogger("asyncio").addFilter(flt)
    return flt
