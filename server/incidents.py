"""Incidents: open alerts that share a cause, grouped so that one cause pages once.

A hot GPU makes a straggler of itself; an XID 79 comes with the ECC errors of the same GPU. Each is an
alert of its own (the engine judges every kind apart), but a person wants one page: the cause, with its
effects under it. The grouping is a pure function of the open alerts, made where alerts leave the server
(like routing labels), never in the detectors, so replay's findings are the same with or without it.

An alert whose kind can be a cause (CAUSE_RANKS) and that no better cause covers is the cause of its
incident, whose id is the cause's alert id. Every other open alert that a cause covers is that incident's
effect: a cause covers the alerts of its own GPU (all of its node's where it is about a whole node) and the
job-wide alerts (no GPU) of the job it runs. An alert nothing covers is the cause of an incident of its own:
a straggler whose clocks a power brake cut names the brake in its `cause` and pages by itself.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Sequence

from gpufleet.server.alerts import Alert, AlertKind, AlertState, IncidentRole, Transition

# Kinds that explain others on their GPU (or node), the most fundamental first: a lost GPU explains its
# XIDs and ECC errors, any of them the heat or the slowness that follows. Where two causes cover each
# other, the better-ranked one (then the older one) leads the incident.
CAUSE_RANKS: Mapping[str, int] = {
    AlertKind.GPU_LOST.value: 0,
    AlertKind.XID.value: 1,
    AlertKind.ECC.value: 2,
    AlertKind.NODE_UNREACHABLE.value: 3,
    AlertKind.THERMAL_THROTTLE.value: 4,
}


@dataclass(frozen=True, slots=True)
class Membership:
    """Which incident an alert belongs to, and whether it is its cause or an effect."""

    incident: str
    role: IncidentRole


def covers(cause: Alert, other: Alert) -> bool:
    """Whether `cause` explains `other`: the same GPU (any GPU of a node-wide cause), or a job-wide alert
    of the job the cause's GPU runs."""
    if cause.node is None:
        return False
    if other.node == cause.node and (cause.gpu is None or cause.gpu == other.gpu):
        return True
    return other.gpu is None and other.hpc_job is not None and other.hpc_job == cause.hpc_job


def group(alerts: Iterable[Alert], ranks: Mapping[str, int] = CAUSE_RANKS) -> dict[str, Membership]:
    """Each open alert's incident and role, by alert id (resolved alerts are left out)."""
    open_alerts = [a for a in alerts if a.state is not AlertState.RESOLVED]
    causes = sorted(
        (a for a in open_alerts if a.kind.value in ranks),
        key=lambda a: (ranks[a.kind.value], a.pending_since, a.id),
    )
    position = {a.id: i for i, a in enumerate(causes)}
    # Causes by node and by job, best first: a fleet's thousands of open alerts look only at their own.
    by_node: dict[str, list[int]] = {}
    by_job: dict[str, list[int]] = {}
    for i, c in enumerate(causes):
        if c.node is not None:
            by_node.setdefault(c.node, []).append(i)
            if c.hpc_job is not None:
                by_job.setdefault(c.hpc_job, []).append(i)
    parent: dict[str, str] = {}
    for alert in open_alerts:
        candidates = by_node.get(alert.node, []) if alert.node is not None else []
        if alert.gpu is None and alert.hpc_job is not None:
            candidates = sorted({*candidates, *by_job.get(alert.hpc_job, ())})
        # Only a better cause may lead: the order is total, so no two alerts lead each other.
        mine = position.get(alert.id, len(causes))
        leader = next((causes[i] for i in candidates if i < mine and covers(causes[i], alert)), None)
        if leader is not None:
            parent[alert.id] = leader.id
    out = {}
    for alert in open_alerts:
        root = alert.id
        while root in parent:
            root = parent[root]
        out[alert.id] = Membership(root, IncidentRole.EFFECT if alert.id in parent else IncidentRole.CAUSE)
    return out


def with_membership(alert: Alert, membership: Membership) -> Alert:
    """The alert carrying its incident and role (itself where they are already these)."""
    if alert.incident == membership.incident and alert.role is membership.role:
        return alert
    return replace(alert, incident=membership.incident, role=membership.role)


class IncidentTracker:
    """Groups the open alerts after each engine step, and remembers each alert's latest incident so that its
    resolution leaves under the labels it fired with."""

    def __init__(self, ranks: Mapping[str, int] = CAUSE_RANKS) -> None:
        self.ranks = ranks
        self._last: dict[str, Membership] = {}

    def restore(self, alerts: Iterable[Alert]) -> None:
        """Remember the incidents that restored alerts were stored with."""
        for a in alerts:
            if a.incident is not None and a.role is not None:
                self._last[a.id] = Membership(a.incident, a.role)

    def step(
        self, open_alerts: Sequence[Alert], transitions: Sequence[Transition]
    ) -> tuple[tuple[Alert, ...], list[Transition]]:
        """The open alerts and the transitions with their incidents, plus a refresh for every open alert
        whose incident changed without a transition of its own (its cause fired or resolved): the store
        and the notifiers take it under its new incident."""
        now = self._sticky(group(open_alerts, self.ranks))
        view = tuple(with_membership(a, now[a.id]) if a.id in now else a for a in open_alerts)
        out = []
        for t in transitions:
            m = now.get(t.alert.id) or self._last.get(t.alert.id) or Membership(t.alert.id, IncidentRole.CAUSE)
            out.append(Transition(with_membership(t.alert, m), t.previous))
        moved = {t.alert.id for t in transitions}
        out += [
            Transition(a, a.state)
            for a in view
            if a.id not in moved and a.id in self._last and self._last[a.id] != now[a.id]
        ]
        self._last = now
        return view, out

    def _sticky(self, now: dict[str, Membership]) -> dict[str, Membership]:
        """The grouping, but an effect whose cause resolved stays in that incident until it resolves too (and
        takes what it explains along): the heat is gone but the straggler it made is still slowing down, and
        one cause must not page twice."""
        kept = {
            alert_id: last
            for alert_id, last in self._last.items()
            if last.role is IncidentRole.EFFECT
            and alert_id in now
            and now[alert_id] == Membership(alert_id, IncidentRole.CAUSE)
            and last.incident not in now
        }
        if not kept:
            return now
        return {
            alert_id: kept.get(alert_id)
            or (Membership(kept[m.incident].incident, IncidentRole.EFFECT) if m.incident in kept else m)
            for alert_id, m in now.items()
        }


@dataclass(frozen=True, slots=True)
class Incident:
    """One cause and the alerts it explains, its effects (oldest first). The cause is None where it is not
    among the alerts grouped: it resolved while its effects stay open."""

    id: str
    cause: Alert | None
    effects: tuple[Alert, ...]


def incidents(alerts: Iterable[Alert]) -> list[Incident]:
    """The incidents of alerts that carry their membership, the newest first (by cause, else first effect)."""
    listed = list(alerts)
    causes = {a.id: a for a in listed if a.role is IncidentRole.CAUSE}
    effects: dict[str, list[Alert]] = {}
    for a in listed:
        if a.role is IncidentRole.EFFECT and a.incident is not None:
            effects.setdefault(a.incident, []).append(a)
    out = [
        Incident(i, causes.get(i), tuple(sorted(effects.get(i, ()), key=lambda a: (a.pending_since, a.id))))
        for i in set(causes) | set(effects)
    ]
    return sorted(out, key=lambda i: (-(i.cause or i.effects[0]).pending_since, i.id))
