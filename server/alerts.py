"""Alert vocabulary shared by the engine (which decides) and the outputs (API, store, notifiers).

The engine owns the lifecycle (pending -> firing -> resolved) so that the live server and offline
replay produce identical alerts; everything downstream only records and forwards Alert values.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from functools import lru_cache
from enum import Enum
from typing import Any, ClassVar, Mapping


# What a kind's name looks like: it is a label value, a metric name part and a URL query value.
KIND_NAME = re.compile(r"[a-z][a-z0-9_]*")


class AlertKind(str):
    """The kind of an alert: the name it is stored, served and exported under, and whether the job is part
    of its subject (a straggler in a new job is a new problem; a hot GPU is the same problem whatever it
    runs). Open: a detector declares its own kinds (engine/detectors), so a new one needs no edit here.
    Equal to its name and to any kind of that name; the flag only matters where fingerprints are made."""

    job_keyed: bool
    # The built-in detectors' kinds, named here because the outputs refer to them (cause, views, tests).
    THERMAL_THROTTLE: ClassVar[AlertKind]
    STRAGGLER: ClassVar[AlertKind]
    COMM_BOUND: ClassVar[AlertKind]
    INPUT_BOUND: ClassVar[AlertKind]
    NODE_UNREACHABLE: ClassVar[AlertKind]
    GPU_LOST: ClassVar[AlertKind]
    XID: ClassVar[AlertKind]
    ECC: ClassVar[AlertKind]

    def __new__(cls, value: str, *, job_keyed: bool = False) -> AlertKind:
        if not isinstance(value, str) or not KIND_NAME.fullmatch(value):
            raise ValueError(f"an alert kind is a lower-case snake_case name, not {value!r}")
        self = super().__new__(cls, value)
        object.__setattr__(self, "job_keyed", job_keyed)
        return self

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("an AlertKind is immutable")

    def __repr__(self) -> str:
        return f"AlertKind({str(self)!r})"

    @property
    def value(self) -> str:
        """The plain name."""
        return str(self)


AlertKind.THERMAL_THROTTLE = AlertKind("thermal_throttle")
AlertKind.STRAGGLER = AlertKind("straggler", job_keyed=True)
AlertKind.COMM_BOUND = AlertKind("comm_bound", job_keyed=True)
AlertKind.INPUT_BOUND = AlertKind("input_bound", job_keyed=True)
AlertKind.NODE_UNREACHABLE = AlertKind("node_unreachable")
AlertKind.GPU_LOST = AlertKind("gpu_lost")
AlertKind.XID = AlertKind("xid")
AlertKind.ECC = AlertKind("ecc")


class Severity(str, Enum):
    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


class IncidentRole(str, Enum):
    """An alert's place in its incident (server/incidents.py): the cause, or an effect of it."""

    CAUSE = "cause"
    EFFECT = "effect"


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
    # What to look at, as its kind's detector says: the second half of the description.
    advice: str = ""
    # The incident it belongs to (its cause's alert id) and its role there, set where the alert leaves the
    # server (server/incidents.py), never by the engine; None where nothing grouped it (replay).
    incident: str | None = None
    role: IncidentRole | None = None

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
            "advice": self.advice,
            "cause": cause(self),
            "labels": dict(self.labels),
            "runbook_url": self.runbook_url,
            "evidence": dict(self.evidence),
            "incident": self.incident,
            "role": None if self.role is None else self.role.value,
        }


def cause(alert: Alert) -> str:
    """The short why of an alert, from a small fixed vocabulary (a label value: a metric series per
    alert must not carry free text): how a straggler holds its job back and what cut its clocks, what
    made a GPU thermal, an XID's code. Empty where the kind says it all."""
    ev = alert.evidence
    if alert.kind == AlertKind.STRAGGLER:
        return "+".join([str(ev.get("pattern") or "")] + list(ev.get("throttle_causes") or ())).strip("+")
    if alert.kind == AlertKind.THERMAL_THROTTLE:
        hot = [
            part
            for part, hit in (
                ("temperature", _at_least(ev.get("temperature_celsius"), ev.get("threshold_celsius"))),
                ("hbm_temperature", ev.get("memory_at_limit")),
            )
            if hit
        ]
        return "+".join(hot + list(ev.get("throttle_reasons") or ()))
    if alert.kind == AlertKind.XID and ev.get("code") is not None:
        return f"xid_{ev['code']}"
    return ""


def description(alert: Alert) -> str:
    """One line for a person reading a notification: the summary, where it is, and what to look at (the
    advice its kind's detector declares)."""
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
        part for part in (alert.summary.rstrip(".") + ".", f"On {subject}." if subject else "", alert.advice) if part
    )


def _at_least(value: Any, limit: Any) -> bool:
    return isinstance(value, (int, float)) and isinstance(limit, (int, float)) and value >= limit


@dataclass(frozen=True, slots=True)
class Transition:
    """An alert that changed state (or was refreshed while firing) during one engine step."""

    alert: Alert
    previous: AlertState | None
