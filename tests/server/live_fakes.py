"""Fakes shared by the live-server tests: a stub engine of the Engine's shape and snapshot builders."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping
from urllib.parse import parse_qs

import httpx
import orjson

from gpufleet.server.ingest.puller import Puller
from gpufleet.server.ingest.targets import StaticTargets
from gpufleet.server.alerts import Alert, AlertKind, AlertState, Severity, Transition, fingerprint


class StepClock:
    """Sample time, moved by the test."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def recorded_agents(lines: list[bytes], clock: StepClock) -> httpx.MockTransport:
    """Each node's agent answering /snapshots?since= with what it had recorded by the clock's time."""
    by_node: dict[str, list[dict]] = {}
    for line in lines:
        snap = orjson.loads(line)
        by_node.setdefault(snap["node"], []).append(snap)

    def answer(request: httpx.Request) -> httpx.Response:
        node = request.url.host
        since = float(parse_qs(request.url.query.decode()).get("since", ["-inf"])[-1])
        snaps = [s for s in by_node[node] if since < s["time"] <= clock.now]
        return httpx.Response(
            200, content=orjson.dumps({"schema": 1, "node": node, "time": clock.now, "snapshots": snaps})
        )

    return httpx.MockTransport(answer)


def hot_puller(clock: StepClock, temps: tuple[float, ...]) -> Puller:
    """A puller whose one target answers every pull with dgx-01's snapshot of 4990 s at `temps`."""
    hot = orjson.dumps(envelope("dgx-01", [snapshot("dgx-01", 4990.0, temps=temps)]))
    return Puller(
        StaticTargets(("a:1",)),
        transport=httpx.MockTransport(lambda r: httpx.Response(200, content=hot)),
        parse=lambda raw: raw,
        clock=clock,
    )


def job_gpu(node: str, i: int, hot: bool) -> dict[str, Any]:
    """GPU `i` of `node` at work in job 71001, a snapshot-contract GPU entry; `hot`: 95 °C with the SW
    thermal slowdown bit."""
    return {
        "index": i,
        "uuid": f"GPU-{node}-{i}",
        "model": "NVIDIA H100",
        "up": True,
        "hpc_job": "71001",
        "utilization_ratio": 1.0,
        "sm_active_ratio": 0.8,
        "temperature_celsius": 95.0 if hot else 62.0,
        "slowdown_temperature_celsius": 90.0,
        "power_watts": 600.0,
        "power_limit_watts": 700.0,
        "sm_clock_hertz": 1.98e9,
        "sm_clock_max_hertz": 1.98e9,
        "throttle_reasons": 0x20 if hot else 0,
    }


def snapshot(node: str, t: float, *, temps: tuple[float, ...] = (60.0, 60.0), job: str | None = "j1") -> dict:
    """A minimal snapshot-contract dict with one entry per GPU temperature."""
    return {
        "schema": 1,
        "node": node,
        "time": t,
        "driver_version": "550.0",
        "nvml_version": None,
        "cuda_driver_version": None,
        "sample_duration_seconds": 0.01,
        "gpus": [
            {
                "index": i,
                "uuid": f"GPU-{node}-{i}",
                "model": "H100",
                "up": True,
                "hpc_job": job,
                "temperature_celsius": temp,
            }
            for i, temp in enumerate(temps)
        ],
    }


def envelope(node: str, snapshots: list[dict]) -> dict:
    """The agent's /snapshots answer."""
    return {"schema": 1, "node": node, "snapshots": snapshots}


def parse_dict(obj: Mapping[str, Any]) -> dict:
    """A stand-in contract parser: requires a node string, a numeric time and a gpus list."""
    if not isinstance(obj, dict) or not isinstance(obj.get("node"), str):
        raise ValueError("node missing")
    if not isinstance(obj.get("time"), (int, float)) or not isinstance(obj.get("gpus"), list):
        raise ValueError("time or gpus missing")
    return obj


@dataclass(frozen=True)
class _Health:
    data: Mapping[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return dict(self.data)


@dataclass
class StubEngine:
    """Fires a warning thermal_throttle for any GPU whose latest temperature is >= 90, resolves below."""

    samples: list[Any] = field(default_factory=list)
    restored: list[Alert] = field(default_factory=list)
    _open: dict[str, Alert] = field(default_factory=dict)
    _latest: dict[tuple[str, int], tuple[float, float, str | None]] = field(default_factory=dict)

    def ingest(self, sample: Any) -> None:
        self.samples.append(sample)
        for gpu in sample["gpus"]:
            key = (sample["node"], gpu["index"])
            if key not in self._latest or self._latest[key][0] < sample["time"]:
                self._latest[key] = (sample["time"], gpu["temperature_celsius"], gpu.get("hpc_job"))

    def advance(self, now: float) -> list[Transition]:
        out = []
        for (node, gpu), (t, temp, job) in sorted(self._latest.items()):
            fp = fingerprint(AlertKind.THERMAL_THROTTLE, node, gpu, job)
            current = self._open.get(fp)
            if temp >= 90 and current is None:
                alert = Alert(
                    id=f"{fp}-{int(t)}",
                    fingerprint=fp,
                    kind=AlertKind.THERMAL_THROTTLE,
                    severity=Severity.WARNING,
                    state=AlertState.FIRING,
                    node=node,
                    gpu=gpu,
                    uuid=f"GPU-{node}-{gpu}",
                    hpc_job=job,
                    pending_since=t,
                    started=t,
                    resolved=None,
                    updated=t,
                    summary=f"{node} GPU {gpu} at {temp:.0f} C",
                    evidence={"temperature_celsius": temp},
                )
                self._open[fp] = alert
                out.append(Transition(alert, None))
            elif temp < 90 and current is not None:
                alert = _replace(current, state=AlertState.RESOLVED, resolved=t, updated=t)
                del self._open[fp]
                out.append(Transition(alert, AlertState.FIRING))
        return out

    def alerts(self) -> list[Alert]:
        return list(self._open.values())

    def restore(self, alerts: list[Alert]) -> None:
        self.restored.extend(alerts)
        for a in alerts:
            self._open[a.fingerprint] = a

    def forget_node(self, node: str, t: float, reason: str) -> list[Transition]:
        out = []
        for fp, alert in list(self._open.items()):
            if alert.node == node:
                del self._open[fp]
                out.append(
                    Transition(
                        _replace(
                            alert,
                            state=AlertState.RESOLVED,
                            resolved=t,
                            updated=t,
                            evidence={**alert.evidence, "resolved_reason": reason},
                        ),
                        AlertState.FIRING,
                    )
                )
        self._latest = {k: v for k, v in self._latest.items() if k[0] != node}
        return out

    def jobs(self) -> list[_Health]:
        jobs = sorted({job for _, _, job in self._latest.values() if job})
        return [
            _Health(
                {
                    "hpc_job": j,
                    "gpus": sum(1 for *_, jj in self._latest.values() if jj == j),
                    "stragglers": [],
                    "comm_bound": False,
                    "estimated_slowdown_ratio": 0.0,
                    "gpu_hours_lost": 0.5,
                    "gpu_hours_lost_by_kind": {"straggler": 0.5},
                }
            )
            for j in jobs
        ]

    def nodes(self) -> list[_Health]:
        return [
            _Health({"node": n, "gpus": sum(1 for (nn, _) in self._latest if nn == n)})
            for n in sorted({n for n, _ in self._latest})
        ]

    def stats(self) -> _Health:
        return _Health({"samples": len(self.samples), "gpus": len(self._latest)})


def _replace(alert: Alert, **changes: Any) -> Alert:
    from dataclasses import replace

    return replace(alert, **changes)


def make_alert(
    n: int,
    *,
    kind: AlertKind = AlertKind.STRAGGLER,
    state: AlertState = AlertState.FIRING,
    severity: Severity = Severity.WARNING,
    node: str | None = "dgx-01",
    gpu: int | None = 0,
    hpc_job: str | None = "71001",
    t: float = 1000.0,
) -> Alert:
    """An alert with distinct id/time per n."""
    fp = fingerprint(kind, node, gpu, hpc_job, extra=str(n))
    resolved = t + n + 50 if state is AlertState.RESOLVED else None
    return Alert(
        id=f"{fp}-{n}",
        fingerprint=fp,
        kind=kind,
        severity=severity,
        state=state,
        node=node,
        gpu=gpu,
        uuid=None if gpu is None else f"GPU-{n}",
        hpc_job=hpc_job,
        pending_since=t + n,
        started=None if state is AlertState.PENDING else t + n + 10,
        resolved=resolved,
        updated=t + n + 10,
        summary=f"alert {n}",
        evidence={"n": n, "peers_median": 0.5},
    )
