"""A generic JSON webhook: one POST per alert state change, delivered from the notifier's own task."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections import deque
from typing import Any, Sequence

import httpx
import orjson

from gpufleet.server.alerts import Transition
from gpufleet.server.notify import Sleep, deliver_until_stopped, post_with_retry

log = logging.getLogger(__name__)


def transition_body(t: Transition) -> dict[str, Any]:
    """The webhook's JSON document for one transition."""
    return {
        "source": "gpufleet",
        "state": t.alert.state.value,
        "previous": None if t.previous is None else t.previous.value,
        "alert": t.alert.to_dict(),
    }


class WebhookNotifier:
    """POSTs each state change (not the refreshes of a firing alert) as JSON to one URL."""

    name = "webhook"

    def __init__(
        self,
        url: str,
        *,
        timeout_seconds: float = 10.0,
        attempts: int = 4,
        backoff_seconds: float = 1.0,
        max_queue: int = 10_000,
        transport: httpx.AsyncBaseTransport | None = None,
        verify: ssl.SSLContext | bool = True,
        auth: httpx.Auth | None = None,
        sleep: Sleep = asyncio.sleep,
        tick_seconds: float = 1.0,
    ) -> None:
        self.url = url
        self.attempts = attempts
        self.backoff_seconds = backoff_seconds
        self.tick_seconds = tick_seconds
        self._sleep = sleep
        self._client = httpx.AsyncClient(
            transport=transport, timeout=httpx.Timeout(timeout_seconds), verify=verify, auth=auth
        )
        self._queue: deque[Transition] = deque()
        self._max_queue = max_queue
        self.sent_total = 0
        self.failed_total = 0
        self.dropped_total = 0

    def submit(self, transitions: Sequence[Transition]) -> None:
        """Queue the state changes; the oldest are dropped (and counted) when the queue is full."""
        for t in transitions:
            if t.previous is t.alert.state:
                continue
            if len(self._queue) >= self._max_queue:
                self._queue.popleft()
                self.dropped_total += 1
            self._queue.append(t)

    async def step(self) -> int:
        """Deliver everything queued now, in order; returns how many were delivered."""
        delivered = 0
        while self._queue:
            t = self._queue.popleft()
            body = orjson.dumps(transition_body(t), option=orjson.OPT_NON_STR_KEYS, default=str)
            if await post_with_retry(
                self._client,
                self.url,
                body,
                attempts=self.attempts,
                backoff_seconds=self.backoff_seconds,
                sleep=self._sleep,
                what=self.name,
            ):
                self.sent_total += 1
                delivered += 1
            else:
                self.failed_total += 1
        return delivered

    async def run(self, stop: asyncio.Event) -> None:
        """Deliver every tick until stopped; errors are counted and logged, never raised."""
        await deliver_until_stopped(self.step, stop, tick_seconds=self.tick_seconds, what="webhook")

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._client.aclose()
