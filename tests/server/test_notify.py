"""Alertmanager v2 push and the generic webhook: payload shape, resend, endsAt, retries, no blocking."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import httpx

from gpufleet.server.alerts import AlertKind, AlertState, Severity, Transition
from gpufleet.server.notify.alertmanager import AlertmanagerNotifier, alertname, rfc3339
from gpufleet.server.notify.webhook import WebhookNotifier
from tests.server.live_fakes import make_alert


class Recorder:
    """A MockTransport handler that records JSON bodies and answers with scripted status codes."""

    def __init__(self, statuses: list[int | Exception] | None = None) -> None:
        self.bodies: list[object] = []
        self.urls: list[str] = []
        self.statuses = list(statuses or [])

    def __call__(self, request: httpx.Request) -> httpx.Response:
        status = self.statuses.pop(0) if self.statuses else 200
        if isinstance(status, Exception):
            raise status
        self.urls.append(str(request.url))
        self.bodies.append(json.loads(request.content))
        return httpx.Response(status)


async def no_sleep(_: float) -> None:
    return None


def firing(n: int = 1, **kw):
    return make_alert(n, **kw)


def am(recorder: Recorder, now: list[float], **kw) -> AlertmanagerNotifier:
    return AlertmanagerNotifier(
        "http://am:9093/",
        transport=httpx.MockTransport(recorder),
        clock=lambda: now[0],
        sleep=no_sleep,
        external_url="http://gpufleet:9472",
        **kw,
    )


def test_alertmanager_payload_shape() -> None:
    rec, now = Recorder(), [2000.0]
    notifier = am(rec, now)
    alert = firing(
        1, kind=AlertKind.THERMAL_THROTTLE, severity=Severity.CRITICAL, node="dgx-03", gpu=5, hpc_job="71001"
    )
    notifier.submit([Transition(alert, AlertState.PENDING)])
    assert asyncio.run(notifier.step())
    assert rec.urls == ["http://am:9093/api/v2/alerts"]
    [body] = rec.bodies[0]
    assert body["labels"] == {
        "alertname": "GpufleetThermalThrottle",
        "kind": "thermal_throttle",
        "severity": "critical",
        "node": "dgx-03",
        "gpu": "5",
        "hpc_job": "71001",
        "source": "gpufleet",
    }
    assert body["annotations"]["summary"] == "alert 1"
    assert json.loads(body["annotations"]["evidence"]) == {"n": 1, "peers_median": 0.5}
    assert body["startsAt"] == rfc3339(alert.started) == "1970-01-01T00:16:51.000Z"
    assert body["endsAt"] == rfc3339(2000.0 + 240.0)
    assert body["generatorURL"] == f"http://gpufleet:9472/ui/alerts/{alert.id}"


def test_job_level_alert_omits_null_labels_and_pending_is_not_sent() -> None:
    rec, now = Recorder(), [0.0]
    notifier = am(rec, now)
    pending = firing(1, state=AlertState.PENDING)
    notifier.submit([Transition(pending, None)])
    notifier.submit([Transition(firing(2, kind=AlertKind.COMM_BOUND, node=None, gpu=None), AlertState.PENDING)])
    asyncio.run(notifier.step())
    [[body]] = rec.bodies
    assert body["labels"]["alertname"] == "GpufleetCommBound"
    assert "node" not in body["labels"] and "gpu" not in body["labels"] and "cause" not in body["labels"]
    assert alertname(pending) == "GpufleetStraggler"


def test_resend_while_firing_and_ends_at_on_resolve() -> None:
    rec, now = Recorder(), [1000.0]
    notifier = am(rec, now, resend_interval_seconds=60)
    alert = firing(1)
    notifier.submit([Transition(alert, AlertState.PENDING)])

    async def scenario():
        await notifier.step()  # t=1000: sent (new + first resend)
        now[0] = 1030
        notifier.submit([Transition(alert, AlertState.FIRING)])  # refresh: nothing new to send
        await notifier.step()
        now[0] = 1061
        await notifier.step()  # resend interval passed: sent again
        now[0] = 1070
        notifier.submit([Transition(replace(alert, state=AlertState.RESOLVED, resolved=1069.0), AlertState.FIRING)])
        await notifier.step()  # resolution goes out at once
        now[0] = 1200
        await notifier.step()  # nothing firing: nothing to resend

    asyncio.run(scenario())
    assert len(rec.bodies) == 3
    assert [b[0]["endsAt"] for b in rec.bodies] == [rfc3339(1240), rfc3339(1301), rfc3339(1069.0)]
    assert notifier.sent_total == 3


def test_escalation_is_sent_at_once_and_ends_the_old_label_set() -> None:
    """Severity is a label, so Alertmanager sees an escalation as a new alert; the warning one must end then.
    The cause, a label too, changes with it: the old label set is ended with the old cause."""
    rec, now = Recorder(), [1000.0]
    notifier = am(rec, now, resend_interval_seconds=60)
    warning = replace(
        firing(1, kind=AlertKind.THERMAL_THROTTLE),
        evidence={"temperature_celsius": 84.0, "threshold_celsius": 83.0, "throttle_reasons": ["sw_thermal_slowdown"]},
    )
    critical = replace(
        warning,
        severity=Severity.CRITICAL,
        updated=1020.0,
        evidence={"temperature_celsius": 88.0, "threshold_celsius": 83.0, "throttle_reasons": ["hw_thermal_slowdown"]},
    )

    async def scenario():
        notifier.submit([Transition(warning, AlertState.PENDING)])
        await notifier.step()
        now[0] = 1021.0
        notifier.submit([Transition(critical, AlertState.FIRING)])  # escalation while firing
        await notifier.step()  # well before the next resend
        now[0] = 1030.0
        notifier.submit([Transition(replace(critical, state=AlertState.RESOLVED, resolved=1029.0), AlertState.FIRING)])
        await notifier.step()

    asyncio.run(scenario())
    sent = [[(b["labels"]["severity"], b["labels"]["cause"], b["endsAt"]) for b in body] for body in rec.bodies]
    hot, hotter = "temperature+sw_thermal_slowdown", "temperature+hw_thermal_slowdown"
    assert sent == [
        [("warning", hot, rfc3339(1240.0))],
        [("warning", hot, rfc3339(1020.0)), ("critical", hotter, rfc3339(1021.0 + 240.0))],
        [("critical", hotter, rfc3339(1029.0))],
    ]


def test_retries_with_backoff_then_counts_failure_and_keeps_resolution() -> None:
    rec, now = Recorder([503, httpx.ConnectError("refused"), 500, 500]), [0.0]
    delays: list[float] = []

    async def sleep(d: float) -> None:
        delays.append(d)

    notifier = AlertmanagerNotifier(
        "http://am:9093",
        transport=httpx.MockTransport(rec),
        clock=lambda: now[0],
        sleep=sleep,
        attempts=4,
        backoff_seconds=0.5,
    )
    alert = firing(1)
    notifier.submit([Transition(replace(alert, state=AlertState.RESOLVED, resolved=5.0), AlertState.FIRING)])
    assert asyncio.run(notifier.step()) is False
    assert delays == [0.5, 1.0, 2.0]
    assert notifier.failed_total == 1
    assert asyncio.run(notifier.step()) is True  # the resolution was kept and goes out next time
    assert rec.bodies[-1][0]["endsAt"] == rfc3339(5.0)
    assert notifier.sent_total == 1


def test_client_error_is_not_retried() -> None:
    rec = Recorder([400])
    notifier = AlertmanagerNotifier("http://am:9093", transport=httpx.MockTransport(rec), sleep=no_sleep)
    notifier.submit([Transition(firing(1), None)])
    assert asyncio.run(notifier.step()) is False
    assert len(rec.bodies) == 1 and notifier.failed_total == 1


def test_submit_never_blocks_on_a_dead_alertmanager() -> None:
    """submit() only queues; delivery happens in step()/run(), so the engine thread never waits on HTTP."""

    def explode(request: httpx.Request) -> httpx.Response:
        raise AssertionError("submit must not send")

    notifier = AlertmanagerNotifier("http://am:9093", transport=httpx.MockTransport(explode))
    notifier.submit([Transition(firing(i), None) for i in range(1000)])


def test_run_loop_delivers_and_stops() -> None:
    rec = Recorder()
    notifier = AlertmanagerNotifier("http://am:9093", transport=httpx.MockTransport(rec), tick_seconds=0.01)
    notifier.submit([Transition(firing(1), None)])

    async def scenario():
        stop = asyncio.Event()
        task = asyncio.create_task(notifier.run(stop))
        while not rec.bodies:
            await asyncio.sleep(0)
        stop.set()
        await asyncio.wait_for(task, 5)
        await notifier.aclose()

    asyncio.run(scenario())
    assert rec.bodies[0][0]["labels"]["kind"] == "straggler"


def test_webhook_posts_state_changes_only() -> None:
    rec = Recorder()
    hook = WebhookNotifier("http://hooks/x", transport=httpx.MockTransport(rec), sleep=no_sleep)
    alert = firing(1)
    hook.submit(
        [
            Transition(replace(alert, state=AlertState.PENDING, started=None), None),
            Transition(alert, AlertState.PENDING),
            Transition(alert, AlertState.FIRING),
            Transition(replace(alert, state=AlertState.RESOLVED, resolved=9.0), AlertState.FIRING),
        ]
    )
    assert asyncio.run(hook.step()) == 3
    assert [(b["previous"], b["state"]) for b in rec.bodies] == [
        (None, "pending"),
        ("pending", "firing"),
        ("firing", "resolved"),
    ]
    assert rec.bodies[1]["alert"]["id"] == alert.id and rec.bodies[1]["source"] == "gpufleet"


def test_webhook_failure_counted_and_queue_bounded() -> None:
    rec = Recorder([500, 500])
    hook = WebhookNotifier(
        "http://hooks/x", transport=httpx.MockTransport(rec), sleep=no_sleep, attempts=2, max_queue=2
    )
    hook.submit([Transition(firing(i), None) for i in range(3)])
    assert hook.dropped_total == 1
    assert asyncio.run(hook.step()) == 1
    assert hook.failed_total == 1 and hook.sent_total == 1


def test_alertmanager_against_a_real_http_server() -> None:
    """One end-to-end POST over real loopback HTTP, so the transport and encoding are exercised."""
    received: list[bytes] = []

    async def scenario():
        done = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0].split(b":")[1])
            received.append(head + await reader.readexactly(length))
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            await writer.drain()
            writer.close()
            done.set()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        notifier = AlertmanagerNotifier(f"http://127.0.0.1:{port}")
        notifier.submit([Transition(firing(1), None)])
        assert await notifier.step()
        await asyncio.wait_for(done.wait(), 5)
        await notifier.aclose()
        server.close()
        await server.wait_closed()

    asyncio.run(scenario())
    head, _, body = received[0].partition(b"\r\n\r\n")
    assert head.startswith(b"POST /api/v2/alerts HTTP/1.1")
    assert json.loads(body)[0]["labels"]["alertname"] == "GpufleetStraggler"
