"""Pushes firing and resolved alerts to Alertmanager's v2 API (`POST /api/v2/alerts`).

Alertmanager forgets an alert that is not re-sent, so every firing alert is re-sent each resend
interval with an `endsAt` a few intervals ahead (if gpufleet dies, its alerts expire on their own),
and a resolved alert is sent once more with `endsAt` set to when it resolved. Alertmanager tells
alerts apart by their labels, so an alert whose severity escalates (its cause may change with it) or that
joins or leaves an incident (labels `incident` and `role`) is sent at once under its new labels, and its
old label set is ended in the same POST rather than left firing until it expires.

The `incident` and `role` labels let Alertmanager page once per cause: deploy/alertmanager/alertmanager.yml
groups by incident and inhibits an incident's effects while its cause fires.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any, Callable, Sequence

import httpx
import orjson

from gpufleet.server.alerts import Alert, AlertState, Transition, cause, description
from gpufleet.server.notify import Sleep, deliver_until_stopped, post_with_retry
from gpufleet.server.routing import alertname

log = logging.getLogger(__name__)


def rfc3339(ts: float) -> str:
    """Unix seconds as an RFC 3339 UTC timestamp with milliseconds."""
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def to_alertmanager(alert: Alert, *, now: float, resend_interval_seconds: float, external_url: str) -> dict[str, Any]:
    """One alert in Alertmanager's postable shape; null subjects are left out of the labels."""
    # `cause` is a label so that routes can send, say, power-brake stragglers to whoever runs the racks. It
    # comes from evidence that is frozen once firing, but for an escalation, when severity changes too.
    labels = {
        "alertname": alertname(alert),
        "kind": alert.kind.value,
        "severity": alert.severity.value,
        "node": alert.node,
        "gpu": None if alert.gpu is None else str(alert.gpu),
        "hpc_job": alert.hpc_job,
        "cause": cause(alert) or None,
        "incident": alert.incident,
        "role": None if alert.role is None else alert.role.value,
        "source": "gpufleet",
        **alert.labels,
    }
    body: dict[str, Any] = {
        "labels": {k: v for k, v in labels.items() if v is not None},
        "annotations": {
            "summary": alert.summary,
            "description": description(alert),
            "evidence": orjson.dumps(dict(alert.evidence), option=orjson.OPT_NON_STR_KEYS, default=str).decode(),
        },
        "startsAt": rfc3339(alert.started if alert.started is not None else alert.pending_since),
        "generatorURL": f"{external_url.rstrip('/')}/ui/alerts/{alert.id}",  # the alert's page, for a person
    }
    if alert.uuid:
        body["annotations"]["uuid"] = alert.uuid
    if alert.runbook_url:
        body["annotations"]["runbook_url"] = alert.runbook_url
    if alert.state is AlertState.RESOLVED:
        body["endsAt"] = rfc3339(alert.resolved if alert.resolved is not None else now)
    else:
        body["endsAt"] = rfc3339(now + 4 * resend_interval_seconds)
    return body


def _key(alert: Alert) -> tuple[str, ...]:
    """An alert occurrence under one label set: its id and the labels that may change while it is open."""
    return (alert.id, alert.severity.value, alert.incident or "", "" if alert.role is None else alert.role.value)


class AlertmanagerNotifier:
    """Batches transitions and delivers them from its own task, so a slow Alertmanager never stalls the engine."""

    name = "alertmanager"

    def __init__(
        self,
        url: str,
        *,
        resend_interval_seconds: float = 60.0,
        external_url: str = "http://localhost:9472",
        timeout_seconds: float = 10.0,
        attempts: int = 4,
        backoff_seconds: float = 1.0,
        transport: httpx.AsyncBaseTransport | None = None,
        verify: ssl.SSLContext | bool = True,
        auth: httpx.Auth | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Sleep = asyncio.sleep,
        tick_seconds: float = 1.0,
    ) -> None:
        self.url = url.rstrip("/") + "/api/v2/alerts"
        self.resend_interval_seconds = resend_interval_seconds
        self.external_url = external_url
        self.attempts = attempts
        self.backoff_seconds = backoff_seconds
        self.tick_seconds = tick_seconds
        self._clock = clock
        self._sleep = sleep
        self._client = httpx.AsyncClient(
            transport=transport, timeout=httpx.Timeout(timeout_seconds), verify=verify, auth=auth
        )
        self._firing: dict[str, Alert] = {}  # alert id -> latest firing state
        # (alert id, its changing labels) -> state to send on the next step; severity, incident and role are
        # part of the key because they are labels: an escalated or regrouped alert's old label set must be
        # ended alongside the new one being sent.
        self._outbox: dict[tuple[str, ...], Alert] = {}
        self._last_resend: float | None = None
        self.sent_total = 0
        self.failed_total = 0
        self.dropped_total = 0

    def submit(self, transitions: Sequence[Transition]) -> None:
        """Queue firing and resolved alerts (pending ones are not Alertmanager's business); never blocks."""
        for t in transitions:
            alert = t.alert
            if alert.state is AlertState.FIRING:
                before = self._firing.get(alert.id)
                self._firing[alert.id] = alert
                if before is not None and _key(before) != _key(alert):
                    self._queue(replace(before, state=AlertState.RESOLVED, resolved=alert.updated))
                    self._queue(alert)
                elif t.previous is not AlertState.FIRING:
                    self._queue(alert)
            elif alert.state is AlertState.RESOLVED and (alert.id in self._firing or t.previous is AlertState.FIRING):
                self._firing.pop(alert.id, None)
                self._queue(alert)

    def _queue(self, alert: Alert) -> None:
        """Send this state of the alert (under its current labels) on the next step."""
        self._outbox[_key(alert)] = alert

    async def step(self) -> bool:
        """Send what is queued, plus every firing alert when the resend interval has passed; True if sent."""
        now = self._clock()
        due = self._last_resend is None or now - self._last_resend >= self.resend_interval_seconds
        batch = {_key(a): a for a in self._firing.values()} if due else {}
        batch.update(self._outbox)
        self._outbox.clear()
        if due:
            self._last_resend = now
        if not batch:
            return True
        payload = [
            to_alertmanager(
                a, now=now, resend_interval_seconds=self.resend_interval_seconds, external_url=self.external_url
            )
            for a in batch.values()
        ]
        ok = await post_with_retry(
            self._client,
            self.url,
            orjson.dumps(payload),
            attempts=self.attempts,
            backoff_seconds=self.backoff_seconds,
            sleep=self._sleep,
            what=self.name,
        )
        if ok:
            self.sent_total += len(payload)
        else:
            self.failed_total += len(payload)
            self._requeue_resolved(batch)
        return ok

    def _requeue_resolved(self, batch: dict[tuple[str, ...], Alert]) -> None:
        """Keep undelivered resolutions for the next step (firing ones go out with the next resend anyway)."""
        for key, alert in batch.items():
            if alert.state is AlertState.RESOLVED and key not in self._outbox:
                self._outbox[key] = alert
        if len(self._outbox) > 10_000:
            self.dropped_total += len(self._outbox) - 10_000
            for key in list(self._outbox)[: len(self._outbox) - 10_000]:
                del self._outbox[key]

    async def run(self, stop: asyncio.Event) -> None:
        """Deliver every tick until stopped; errors are counted and logged, never raised."""
        await deliver_until_stopped(self.step, stop, tick_seconds=self.tick_seconds, what="alertmanager")

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._client.aclose()
