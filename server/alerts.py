"""Alert vocabulary shared by the engine (which decides) and the outputs (API, store, notifiers).

The engine owns the lifecycle (pending -> firing -> resolved) so that the live server and offline
replay produce identical alerts; everything downstream only records and forwards Alert values.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import lru_cache
from enum import Enum
from typing import Any, Mapping


class AlertKind(str, Enum):
    THERMAL_THROTTLE = "thermal_throttle"
    STRAGGLER = "straggler"
    COMM_BOUND = "comm_bound"
    INPUT_BOUND = "input_bound"
    NODE_UNREACHABLE = "node_unreachable"
    GPU_LOST = "gpu_lost"
    XID = "xid"
    ECC = "ecc"


class Severity(str, Enum):
    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


class AlertState(str, Enum):
    PENDING = "pending"
    FIRING = "firing"
    RESOLVED = "resolved"


# Detectors ask for the same few subjects' fingerprints every tick: hashing them each time showed up
# in replay profiles. A pure function of its arguments, so memoising it changes nothing else.
@lru_cache(maxsize=1 << 16)
def fingerprint(kind: AlertKind, node: str | None, gpu: int | None, hpc_job: str | None, extra: str = "") -> str:
    """Stable identity of an alert subject: the same problem on the same GPU/job keeps one id."""
    key = f"{kind.value}|{node or ''}|{'' if gpu is None else gpu}|{hpc_job or ''}|{extra}"
    return hashlib.sha1(key.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Alert:
    """One alert occurrence. `started` is the sample time it began firing (None while pending)."""

    id: str  # fingerprint + pending_since: unique per occurrence
    fingerprint: str
    kind: AlertKind
    severity: Severity
    state: AlertState
    node: str | None
    gpu: int | None
    uuid: str | None
    hpc_job: str | None
    pending_since: float
    started: float | None
    resolved: float | None
    updated: float
    summary: str
    evidence: Mapping[str, Any] = field(default_factory=dict)
    # Routing labels set where the alert leaves the server (server/routing.py), never by the engine:
    # the configured external labels and the Kubernetes namespace/pod of its subject.
    labels: Mapping[str, str] = field(default_factory=dict)
    runbook_url: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The replay / REST shape of an alert."""
        return {
            "id": self.id,
            "fingerprint": self.fingerprint,
            "kind": self.kind.value,
            "severity": self.severity.value,
            "state": self.state.value,
            "node": self.node,
            "gpu": self.gpu,
            "uuid": self.uuid,
            "hpc_job": self.hpc_job,
            "pending_since": self.pending_since,
            "started": self.started,
            "resolved": self.resolved,
            "updated": self.updated,
            "summary": self.summary,
            "description": description(self),
            "cause": cause(self),
            "labels": dict(self.labels),
            "runbook_url": self.runbook_url,
            "evidence": dict(self.evidence),
        }


def cause(alert: Alert) -> str:
    """The short why of an alert, from a small fixed vocabulary (a label value: a metric series per
    alert must not carry free text): how a straggler holds its job back and what cut its clocks, what
    made a GPU thermal, an XID's code. Empty where the kind says it all."""
    ev = alert.evidence
    if alert.kind is AlertKind.STRAGGLER:
        return "+".join([str(ev.get("pattern") or "")] + list(ev.get("throttle_causes") or ())).strip("+")
    if alert.kind is AlertKind.THERMAL_THROTTLE:
        hot = [
            part
            for part, hit in (
                ("temperature", _at_least(ev.get("temperature_celsius"), ev.get("threshold_celsius"))),
                ("hbm_temperature", ev.get("memory_at_limit")),
            )
            if hit
        ]
        return "+".join(hot + list(ev.get("throttle_reasons") or ()))
    if alert.kind is AlertKind.XID and ev.get("code") is not None:
        return f"xid_{ev['code']}"
    return ""


# What to look at, by kind: the second half of an alert's description (its first half is the summary).
_ADVICE = {
    AlertKind.THERMAL_THROTTLE: "The GPU cuts its clocks while this hot: check the node's cooling (fans, airflow, "
    "inlet temperature).",
    AlertKind.STRAGGLER: "Its peers wait for it at every synchronisation, so the whole job runs at its pace: "
    "drain it, or restart the job without it.",
    AlertKind.COMM_BOUND: "Every GPU of the job waits in collectives: check the fabric (NVLink, InfiniBand or "
    "RoCE errors, congestion, a changed topology).",
    AlertKind.INPUT_BOUND: "The GPUs starve for input: check data loading, storage and the hosts' CPUs.",
    AlertKind.NODE_UNREACHABLE: "Its GPUs are not monitored: check the node, its network and gpufleet-agent there.",
    AlertKind.GPU_LOST: "The GPU stopped answering (fell off the bus, XID 79 in the kernel log): drain the node.",
    AlertKind.XID: "The driver reported an XID error: NVIDIA's XID catalogue says what the code means.",
    AlertKind.ECC: "Its memory has uncorrectable errors: drain the GPU and check its remapped rows.",
}


def description(alert: Alert) -> str:
    """One line for a person reading a notification: the summary, where it is, and what to look at."""
    where = [
        f"node {alert.node}" if alert.node else "",
        f"GPU {alert.gpu}" + (f" ({alert.uuid})" if alert.uuid else "") if alert.gpu is not None else "",
        f"job {alert.hpc_job}" if alert.hpc_job else "",
        "pod {}/{}".format(alert.labels["namespace"], alert.labels["pod"])
        if "namespace" in alert.labels and "pod" in alert.labels
        else "",
    ]
    subject = ", ".join(part for part in where if part)
    return " ".join(
        part
        for part in (alert.summary.rstrip(".") + ".", f"On {subject}." if subject else "", _ADVICE.get(alert.kind, ""))
        if part
    )


def _at_least(value: Any, limit: Any) -> bool:
    return isinstance(value, (int, float)) and isinstance(limit, (int, float)) and value >= limit


@dataclass(frozen=True, slots=True)
class Transition:
    """An alert that changed state (or was refreshed while firing) during one engine step."""

    alert: Alert
    previous: AlertState | None
