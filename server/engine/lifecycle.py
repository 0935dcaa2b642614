"""Alert lifecycle: pending -> firing -> resolved, one open alert per fingerprint.

A finding opens a pending alert; it fires once the condition has held for the kind's `for` duration
(`started` is that sample time), as the finding, or unsmoothed in every newest bin since the finding's
held_since (a detector that tracks it: its smoothed finding confirms what the newest bins show). A pending alert whose condition stops holding is dropped, unless it
returns within the pending grace; the ticks it was off do not count towards `for`. A firing
alert resolves only after its detector's clear condition (stricter than "not on": hysteresis) has held
for the kind's clear duration; "no data" neither advances nor resets that clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from gpufleet.server.alerts import Alert, AlertKind, AlertState, Severity, Transition
from gpufleet.server.engine.detectors import Finding, Outcome

_LIVE_KEYS = frozenset(
    (
        "gpu_hours_lost",
        "silent_seconds",
        "count",
        "last_event_time",
        "uncorrected_errors_new",
        "last_error_time",
        "remapped_rows_pending",
        "remapped_rows_failure",
    )
)
_RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.CRITICAL: 2}


@dataclass(slots=True)
class _Record:
    """Mutable state of one open alert."""

    id: str
    fingerprint: str
    kind: AlertKind
    node: str | None
    gpu: int | None
    uuid: str | None
    hpc_job: str | None
    pending_since: float
    severity: Severity
    summary: str
    evidence: Mapping[str, Any] = field(default_factory=dict)
    state: AlertState = AlertState.PENDING
    started: float | None = None
    updated: float = 0.0
    clear_since: float | None = None
    off_since: float | None = None
    # Seconds a pending alert's condition was off within the grace: the condition did not hold then.
    off_seconds: float = 0.0
    # A restored alert already accounts for every tick up to its last update: agents re-send their
    # buffers after a server restart, and re-judging those old ticks would resolve and re-open it.
    settled_until: float = float("-inf")
    advice: str = ""
    restored: bool = False

    def alert(self, resolved: float | None = None, state: AlertState | None = None) -> Alert:
        """Immutable snapshot of this record."""
        return Alert(
            self.id,
            self.fingerprint,
            self.kind,
            self.severity,
            state or self.state,
            self.node,
            self.gpu,
            self.uuid,
            self.hpc_job,
            self.pending_since,
            self.started,
            resolved,
            self.updated,
            self.summary,
            dict(self.evidence),
            advice=self.advice,
        )


def _held(t: float, rec: _Record, f: Finding, for_s: float, onset_lead: float, early: float) -> bool:
    """Whether a pending alert's condition has held for `for_s`: as the finding (its pending time, less
    the ticks it was off), or unsmoothed in every newest bin since its held_since where that lies no
    more than `onset_lead` before the finding's first tick (how late the smoothing confirms a change: a
    subject standing out long before its finding, a pipeline's busier last stage, shows no change).

    A run that began up to `early` seconds before that is counted from the lead: noise can make a subject
    stand out in a few newest bins before its change, and that should not cost it the lead."""
    if t - rec.pending_since - rec.off_seconds >= for_s:
        return True
    since = f.held_since
    if since is None or since < rec.pending_since - onset_lead - early:
        return False
    return t - max(since, rec.pending_since - onset_lead) >= for_s


class Lifecycle:
    """Open alerts keyed by fingerprint, stepped once per tick."""

    def __init__(
        self,
        durations: Mapping[AlertKind, tuple[float, float]],
        pending_grace: float = 0.0,
        advice: Mapping[AlertKind, str] | None = None,
        onset_lead: Mapping[AlertKind, float] | None = None,
        early_run: Mapping[AlertKind, float] | None = None,
    ) -> None:
        self.durations = dict(durations)
        self.pending_grace = pending_grace
        self.onset_lead = dict(onset_lead or {})  # kind -> seconds, see _held
        self.early_run = dict(early_run or {})  # kind -> seconds, see _held
        self.advice = dict(advice or {})  # kind -> what to look at, carried by its alerts
        self.records: dict[str, _Record] = {}

    def step(self, t: float, outcomes: Mapping[AlertKind, Outcome]) -> list[Transition]:
        """Apply one tick of findings; returns every state change (and severity escalations)."""
        out: list[Transition] = []
        for kind, outcome in outcomes.items():
            for_s, clear_s = self.durations[kind]
            for fp, finding in outcome.findings.items():
                rec = self.records.get(fp)
                if rec is None or t > rec.settled_until:
                    self._on(t, fp, finding, for_s, out)
            for fp in [
                fp
                for fp, r in self.records.items()
                if r.kind == kind and fp not in outcome.findings and t > r.settled_until
            ]:
                self._off(t, self.records[fp], outcome.clear(fp), clear_s, out)
        return out

    def _on(self, t: float, fp: str, f: Finding, for_s: float, out: list[Transition]) -> None:
        """The condition holds: open, keep pending, fire, or refresh."""
        rec = self.records.get(fp)
        if rec is None:
            rec = self.records[fp] = _Record(
                f"{fp}-{int(t)}",
                fp,
                f.kind,
                f.node,
                f.gpu,
                f.uuid,
                f.hpc_job,
                t,
                f.severity,
                f.summary,
                f.evidence,
                updated=t,
                advice=self.advice.get(f.kind, ""),
            )
            if for_s > 0:
                out.append(Transition(rec.alert(), None))
        rec.clear_since = None
        if rec.off_since is not None and rec.state is AlertState.PENDING:
            # Two brief jitters of one GPU 11 s apart, each shorter than `for`, fired as one straggler
            # when the gap counted as held, and named it after both were over.
            rec.off_seconds += t - rec.off_since
        rec.off_since = None
        rec.updated = t
        rec.uuid = f.uuid or rec.uuid
        escalated = _RANK[f.severity] > _RANK[rec.severity]
        if rec.state is AlertState.PENDING or escalated:
            rec.summary, rec.evidence = f.summary, f.evidence
        else:
            # Once firing, the evidence that fired it stays; only running tallies keep counting.
            rec.evidence = {**rec.evidence, **{k: v for k, v in f.evidence.items() if k in _LIVE_KEYS}}
            if f.live_summary:
                rec.summary = f.summary
        if escalated:
            rec.severity = f.severity
        if rec.state is AlertState.PENDING and _held(
            t, rec, f, for_s, self.onset_lead.get(f.kind, 0.0), self.early_run.get(f.kind, 0.0)
        ):
            previous = AlertState.PENDING if for_s > 0 else None
            rec.state, rec.started = AlertState.FIRING, t
            out.append(Transition(rec.alert(), previous))
        elif rec.state is AlertState.FIRING and escalated:
            out.append(Transition(rec.alert(), AlertState.FIRING))

    def _off(self, t: float, rec: _Record, clear: bool | None, clear_s: float, out: list[Transition]) -> None:
        """The condition does not hold: drop a pending alert, or count towards resolving a firing one."""
        if rec.state is AlertState.PENDING:
            if clear is None:
                return
            if rec.off_since is None:
                rec.off_since = t
            if not clear and t - rec.off_since < self.pending_grace:
                return
            del self.records[rec.fingerprint]
            rec.updated = t
            out.append(Transition(rec.alert(state=AlertState.RESOLVED), AlertState.PENDING))
            return
        if clear is None:
            return
        if not clear:
            rec.clear_since = None
            return
        if rec.clear_since is None:
            rec.clear_since = t
        if t - rec.clear_since >= clear_s:
            del self.records[rec.fingerprint]
            rec.updated = t
            out.append(Transition(rec.alert(resolved=t, state=AlertState.RESOLVED), AlertState.FIRING))

    def close_node(self, node: str, t: float, reason: str) -> list[Transition]:
        """Resolve every open alert about a node at once, saying why in evidence.resolved_reason (a node
        no longer watched: its conditions can neither hold nor clear any more)."""
        out: list[Transition] = []
        for fp in [fp for fp, r in self.records.items() if r.node == node]:
            rec = self.records.pop(fp)
            rec.updated = max(t, rec.updated)
            rec.evidence = {**rec.evidence, "resolved_reason": reason}
            out.append(Transition(rec.alert(resolved=rec.updated, state=AlertState.RESOLVED), rec.state))
        return out

    def alerts(self) -> list[Alert]:
        """Pending and firing alerts, oldest first."""
        return sorted((r.alert() for r in self.records.values()), key=lambda a: (a.pending_since, a.id))

    def opened(self, fp: str) -> float | None:
        """When the open alert of a fingerprint opened (pending_since); None when none is open."""
        rec = self.records.get(fp)
        return None if rec is None else rec.pending_since

    def open_jobs(self, kinds: Iterable[AlertKind], since: float = float("-inf")) -> set[str]:
        """hpc_jobs with an open alert of the given kinds (opened at or after `since`)."""
        return {job for job, _, _ in self.open_subjects(kinds, since) if job is not None}

    def open_subjects(
        self, kinds: Iterable[AlertKind], since: float = float("-inf")
    ) -> dict[tuple[str | None, str | None, int | None], float]:
        """(hpc_job, node, gpu) of every open alert of the given kinds (opened at or after `since`), each
        with when it opened."""
        wanted = set(kinds)
        return {
            (r.hpc_job, r.node, r.gpu): r.pending_since
            for r in self.records.values()
            if r.kind in wanted and r.pending_since >= since
        }

    def restored_evidence(self, fp: str) -> Mapping[str, Any] | None:
        """The evidence of an open alert taken over at a restart (what it was judged against, which a
        detector that has not re-learned its subject has no other source for); None for any other."""
        rec = self.records.get(fp)
        return rec.evidence if rec is not None and rec.restored else None

    def restore(self, alerts: Iterable[Alert]) -> int:
        """Re-seed open alerts (ids, pending_since, started kept); returns how many were taken."""
        taken = 0
        for a in alerts:
            if a.state not in (AlertState.PENDING, AlertState.FIRING) or a.fingerprint in self.records:
                continue
            self.records[a.fingerprint] = _Record(
                a.id,
                a.fingerprint,
                a.kind,
                a.node,
                a.gpu,
                a.uuid,
                a.hpc_job,
                a.pending_since,
                a.severity,
                a.summary,
                dict(a.evidence),
                a.state,
                a.started,
                a.updated,
                settled_until=a.updated,
                # A store written before alerts kept their advice has none: the kind's own is the same.
                advice=a.advice or self.advice.get(a.kind, ""),
                restored=True,
            )
            taken += 1
        return taken
