"""`node_unreachable` for agents the engine cannot speak for, raised from the sample source's target health.

The engine raises `node_unreachable` when a node it knows stops sending samples. It cannot for an
agent that has not delivered a single sample since the server started: one that was already down
(or mistyped) when the server came up, or one that answers but has nothing to send. This module
covers exactly those targets and stands down as soon as the engine knows the node, so one outage
never raises two alerts. Its alerts carry `evidence.source = "ingest"`, which keeps them out of the
engine on restore, and use wall-clock time (they describe the live pipeline; replay has no targets).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Collection, Iterable, Mapping, Sequence

from gpufleet.server.alerts import Alert, AlertKind, AlertState, Severity, Transition, fingerprint
from gpufleet.server.engine import registry
from gpufleet.server.ingest.base import TargetHealth

SOURCE = "ingest"
# The engine's node_unreachable says what to look at; these alerts are the same problem.
_ADVICE = registry.advice(registry.STANDARD)[AlertKind.NODE_UNREACHABLE]


def is_ours(alert: Alert) -> bool:
    """Whether an alert was raised here rather than by the engine."""
    return alert.evidence.get("source") == SOURCE


@dataclass(slots=True)
class _Open:
    """A target currently down or stale, and its alert once firing."""

    since: float
    alert: Alert | None = None
    restored: bool = False  # taken back from the store at start, and nothing new heard from the target since
    quiet_since: float | None = None  # the target's last_new_data when first seen answering after the restart


class AgentAlerts:
    """Per-target down/stale alerts for nodes the engine does not track; stepped once per cycle."""

    def __init__(self, *, after_seconds: float = 30.0) -> None:
        self.after_seconds = after_seconds
        self._open: dict[str, _Open] = {}  # target -> state while it is down or stale
        self.nodes: dict[str, str] = {}  # target -> node name it last reported (survives restarts)

    def restore(self, alerts: Iterable[Alert], nodes: Mapping[str, str]) -> int:
        """Take back this module's open alerts and the remembered target -> node names; returns alerts taken."""
        self.nodes.update(nodes)
        taken = 0
        for a in alerts:
            target = a.evidence.get("target")
            if is_ours(a) and isinstance(target, str) and a.state is not AlertState.RESOLVED:
                self._open[target] = _Open(a.pending_since, a, restored=True)
                taken += 1
        return taken

    def learn(self, health: Sequence[TargetHealth]) -> dict[str, str]:
        """Record the node name each target reports; returns the names that are new or changed."""
        changed = {h.target: h.node for h in health if h.node and self.nodes.get(h.target) != h.node}
        self.nodes.update(changed)
        return changed

    def step(self, health: Sequence[TargetHealth], covered: Collection[str], now: float) -> list[Transition]:
        """Fire or resolve per target; `covered` are the nodes the engine tracks or holds node_unreachable about."""
        out: list[Transition] = []
        current = {h.target: h for h in health}
        for target in [t for t in self._open if t not in current]:  # dropped from discovery: nothing to watch
            self._close(target, now, out)
        for h in health:
            node = h.node or self.nodes.get(h.target)
            if node is not None and node in covered:
                self._close(h.target, now, out)
            elif h.up and not h.stale and not self._held(h):
                self._close(h.target, now, out)
            else:
                self._bad(h, node, now, out)
        return out

    def alerts(self) -> list[Alert]:
        """Firing alerts, oldest first."""
        return sorted((o.alert for o in self._open.values() if o.alert is not None), key=lambda a: a.pending_since)

    def _held(self, h: TargetHealth) -> bool:
        """Whether a restored alert stays open although its target reads up and fresh: a source counts its
        first answer after a restart as new data, so a target whose snapshots are all rejected reads fresh
        for one stale-after. Resolved then, its alert would come back under a new id and start (Alertmanager
        would see a resolve and a new alert on every restart). Held until the target delivers something
        new (its last_new_data moves) or the engine takes its node."""
        state = self._open.get(h.target)
        if state is None or not state.restored:
            return False
        if state.quiet_since is None:
            state.quiet_since = h.last_new_data
        if h.last_new_data is None or h.last_new_data == state.quiet_since:
            return True
        state.restored = False
        return False

    def _bad(self, h: TargetHealth, node: str | None, now: float, out: list[Transition]) -> None:
        """A target down or stale that the engine cannot see: fire once it has lasted this long."""
        state = self._open.setdefault(h.target, _Open(now))
        # A stale target has already been silent for the source's stale-after; a down one is timed from here.
        if state.alert is None and (h.stale or now - state.since >= self.after_seconds):
            state.alert = _alert(h, node, state.since, now, self.after_seconds)
            out.append(Transition(state.alert, None))

    def _close(self, target: str, now: float, out: list[Transition]) -> None:
        """The target answers with samples again, the engine has its node, or it is gone: resolve."""
        state = self._open.pop(target, None)
        if state is not None and state.alert is not None:
            out.append(
                Transition(
                    replace(state.alert, state=AlertState.RESOLVED, resolved=now, updated=now), AlertState.FIRING
                )
            )


def _alert(h: TargetHealth, node: str | None, since: float, now: float, after: float) -> Alert:
    """The alert for one target, firing from now."""
    fp = fingerprint(AlertKind.NODE_UNREACHABLE, None, None, None, extra=f"target={h.target}")
    if h.stale:
        what = f"agent {h.target} answers but has sent no new sample since the server started"
    elif h.last_success is None:
        what = f"agent {h.target} has not answered since the server started ({h.last_error})"
    else:
        what = f"agent {h.target} has not answered for {now - since:.0f} s ({h.last_error})"
    evidence = {
        "source": SOURCE,
        "target": h.target,
        "reason": "stale" if h.stale else "down",
        "consecutive_failures": h.consecutive_failures,
        "last_error": h.last_error,
        "last_success": h.last_success,
        "last_sample_time": h.last_sample_time,
        "threshold_seconds": after,
    }
    return Alert(
        id=f"{fp}-{int(since)}",
        fingerprint=fp,
        kind=AlertKind.NODE_UNREACHABLE,
        severity=Severity.CRITICAL,
        state=AlertState.FIRING,
        node=node or h.target,
        gpu=None,
        uuid=None,
        hpc_job=None,
        pending_since=since,
        started=now,
        resolved=None,
        updated=now,
        summary=what if node is None else f"{what}; its node {node} is not being watched",
        evidence=evidence,
        advice=_ADVICE,
    )
