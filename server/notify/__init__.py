"""Outputs that forward alert transitions elsewhere (Alertmanager, webhooks), off the engine's path."""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Protocol, Sequence

import httpx

from gpufleet.server.alerts import Transition

log = logging.getLogger(__name__)

Sleep = Callable[[float], Awaitable[None]]


class Notifier(Protocol):
    """Receives transitions without blocking; delivers them from its own task."""

    name: str
    url: str  # where it delivers (no credentials: the settings refuse them in URLs)
    sent_total: int
    failed_total: int
    dropped_total: int

    def submit(self, transitions: Sequence[Transition]) -> None: ...

    async def run(self, stop: asyncio.Event) -> None: ...

    async def aclose(self) -> None: ...


async def post_with_retry(
    client: httpx.AsyncClient, url: str, body: bytes, *, attempts: int, backoff_seconds: float, sleep: Sleep, what: str
) -> bool:
    """POST JSON, retrying connection errors and 5xx/429 with doubling backoff; True when delivered."""
    delay = backoff_seconds
    for attempt in range(1, attempts + 1):
        try:
            response = await client.post(url, content=body, headers={"content-type": "application/json"})
            if response.status_code < 300:
                return True
            retryable = response.status_code >= 500 or response.status_code == 429
            error = f"HTTP {response.status_code}"
        except (httpx.HTTPError, OSError) as exc:
            # OSError covers ssl.SSLError: under TLS 1.3 a receiver refusing our client certificate says so
            # on the first read, which httpx passes on as it is.
            retryable, error = True, f"{exc.__class__.__name__}: {exc}"
        log.warning(
            "notification failed",
            extra={
                "notifier": what,
                "url": url,
                "attempt": attempt,
                "error": error[:300],
                "retrying": retryable and attempt < attempts,
            },
        )
        if not retryable or attempt == attempts:
            return False
        await sleep(delay)
        delay *= 2
    return False


async def deliver_until_stopped(
    step: Callable[[], Awaitable[object]], stop: asyncio.Event, *, tick_seconds: float, what: str
) -> None:
    """Run a notifier's delivery step every tick until stopped; a failing step is logged, never fatal."""
    while not stop.is_set():
        try:
            await step()
        except Exception:  # noqa: BLE001 - delivery must outlive a bug in one batch
            log.exception("notification delivery step failed", extra={"notifier": what})
        try:
            await asyncio.wait_for(stop.wait(), timeout=tick_seconds)
        except asyncio.TimeoutError:
            pass
