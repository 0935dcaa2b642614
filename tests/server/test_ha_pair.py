"""An HA pair: two servers, each with its own engine, pulling the same agents on their own schedules and
pushing to one real Alertmanager, which must hold each incident once."""

from __future__ import annotations

import asyncio
import random

import httpx

from gpufleet.server.alerts import AlertState, cause
from gpufleet.server.contract import parse_line
from gpufleet.server.engine import Engine, EngineConfig
from gpufleet.server.notify.alertmanager import AlertmanagerNotifier
from tests.agent.running import alertmanager_process, requires_alertmanager
from tests.server.engine_samples import MAX_HZ, T0, cluster_lines


def _incidents(t, node, gpu):
    """From 400 s GPU n1/3's power brake cuts its clocks while its peers wait; n0/6 runs hot."""
    if t < 400:
        return {}
    if (node, gpu) == ("n1", 3):
        return {"sm_clock_hertz": 0.7 * MAX_HZ, "throttle_reasons": 0x88, "power_watts": 330.0}
    if (node, gpu) == ("n0", 6):
        return {"temperature_celsius": 88.0, "throttle_reasons": 0x40, "sm_active_ratio": 0.6, "power_watts": 410.0}
    return {"sm_active_ratio": 0.6, "power_watts": 410.0}


def _replica(samples, step: float, phase: float) -> list:
    """One server's engine: it pulls every `step` seconds from `phase`, receiving each pull's samples in
    an order of its own, and evaluates after each pull, a bin once the pull interval and timeout have
    passed (as `serve` configures it). Its transitions, in order."""
    engine, out, i = Engine(EngineConfig(settle_seconds=step + 4.0)), [], 0
    t = T0 + phase
    while t <= samples[-1].time + 60.0:
        batch = []
        while i < len(samples) and samples[i].time < t:
            batch.append(samples[i])
            i += 1
        random.Random(int(t * 10)).shuffle(batch)
        for s in batch:
            engine.ingest(s)
        out += engine.advance(t)
        t += step
    return out


@requires_alertmanager
def test_alertmanager_holds_each_incident_of_an_ha_pair_once(tmp_path):
    samples = sorted((parse_line(line) for line in cluster_lines(700, override=_incidents)), key=lambda s: s.time)
    replicas = [_replica(samples, 5.0, 0.0), _replica(samples, 5.0, 3.3)]
    firing = [
        {a.id for a in (tr.alert for tr in transitions) if a.state is AlertState.FIRING} for transitions in replicas
    ]
    assert firing[0] == firing[1] and len(firing[0]) >= 2

    with alertmanager_process(tmp_path) as (_, port, log_path):
        url = f"http://127.0.0.1:{port}"

        async def push() -> None:
            notifiers = [AlertmanagerNotifier(url, external_url=f"http://srv-{i}:9472") for i, _ in enumerate(replicas)]
            try:
                for notifier, transitions in zip(notifiers, replicas):
                    # Every alert as it fired, none resolved (Alertmanager would show a resolved one too): its
                    # endsAt ahead of Alertmanager's own clock keeps each active.
                    notifier.submit([tr for tr in transitions if tr.alert.state is not AlertState.RESOLVED])
                    assert await notifier.step(), log_path.read_text(errors="replace")[-2000:]
            finally:
                for notifier in notifiers:
                    await notifier.aclose()

        asyncio.run(push())
        held = httpx.get(f"{url}/api/v2/alerts", params={"active": "true"}, timeout=10).json()

    expected = {}
    for tr in replicas[0]:
        if tr.alert.state is AlertState.FIRING:
            expected[tr.alert.id] = tr.alert
    subjects = sorted(
        (a["labels"]["alertname"], a["labels"].get("node"), a["labels"].get("gpu"), a["labels"].get("cause"))
        for a in held
    )
    assert subjects == sorted(
        {
            (
                "Gpufleet" + "".join(p.capitalize() for p in a.kind.value.split("_")),
                a.node,
                None if a.gpu is None else str(a.gpu),
                cause(a) or None,
            )
            for a in expected.values()
        }
    )
    assert ("GpufleetStraggler", "n1", "3", "gpu_clocks_cut+hw_slowdown_or_power_brake") in subjects
