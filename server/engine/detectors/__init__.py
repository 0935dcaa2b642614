"""Detectors: each turns one tick's windows into findings (subjects whose alert condition holds now)
and a clear test for subjects that had an alert open. The lifecycle decides what that means over time."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AbstractSet, Any, Callable, Iterable, Mapping, Protocol, Sequence

import numpy as np

from gpufleet.server.alerts import AlertKind, Severity, fingerprint
from gpufleet.server.engine.arrays import grown
from gpufleet.server.engine.groups import JOB, GroupHistory, GroupRegistry
from gpufleet.server.engine.units import EVIDENCE_DIGITS
from gpufleet.server.engine.windows import CounterEvent


class OpenAlerts(Protocol):
    """The open alerts as a detector may ask about them (the lifecycle before this tick's step)."""

    def opened(self, fp: str) -> float | None:
        """When the open alert of a fingerprint opened; None when none is open."""
        ...

    def open_jobs(self, kinds: Iterable[AlertKind], since: float = float("-inf")) -> set[str]:
        """hpc_jobs with an open alert of the given kinds (opened at or after `since`)."""
        ...

    def open_subjects(
        self, kinds: Iterable[AlertKind], since: float = float("-inf")
    ) -> dict[tuple[str | None, str | None, int | None], float]:
        """(hpc_job, node, gpu) of every open alert of the given kinds, each with when it opened."""
        ...

    def restored_evidence(self, fp: str) -> Mapping[str, Any] | None:
        """The evidence of an open alert taken over from the store at a restart; None for any other."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Context:
    """What a detector reads besides the tick and its own state: the groups' history, the open alerts,
    what the engine remembers per GPU, and what the detectors run before it concluded this tick (each
    set is the union of what they contributed in their Detection, see spec.joined)."""

    history: GroupHistory  # per-group baselines, medians and noise (job-level drops are measured on it)
    alerts: OpenAlerts
    last_busy_time: np.ndarray  # per slot: the last evaluation time it was busy (-inf: never)
    last_group: np.ndarray  # per slot: the last group it was in (-1: none yet)
    events: Sequence[CounterEvent] = ()  # health counter increases drained from the windows this tick
    halted: AbstractSet[int] = frozenset()  # groups hung by a lost GPU: no straggler among the GPUs left
    explained: AbstractSet[int] = frozenset()  # groups whose drop a straggler, heat or a lost GPU explains
    standout: AbstractSet[int] = frozenset()  # groups where a GPU or node stands out, or on a silent node
    idling: AbstractSet[int] = frozenset()  # groups where one idles below its peers, or on a silent node
    # Groups where a GPU or node stands out or is named: an unattributed one's GPU models are not
    # re-inferred meanwhile (see Engine._inferred_in_trouble).
    singled_out: AbstractSet[int] = frozenset()


def job_groups(registry: GroupRegistry, jobs: Iterable[str | None]) -> set[int]:
    """Group ids of the named jobs that have a group now."""
    ids = registry.ids
    return {ids[(JOB, job)] for job in jobs if job is not None and (JOB, job) in ids}


@dataclass(slots=True)
class Finding:
    """A subject whose condition holds at this tick, with the numbers that say so."""

    kind: AlertKind
    node: str | None
    gpu: int | None
    uuid: str | None
    hpc_job: str | None
    severity: Severity
    summary: str
    evidence: Mapping[str, Any] = field(default_factory=dict)
    extra: str = ""
    # GPU-hours the subject cost its job at this tick alone (evidence's gpu_hours_lost is the running total).
    cost_gpu_hours: float = 0.0
    # The summary quotes only running tallies (the evidence's live keys), so a firing alert takes each new
    # one with them: a summary kept from when it fired would contradict the evidence beside it.
    live_summary: bool = False
    # Sample time from which the condition has held in every newest bin, unsmoothed (None: not tracked).
    # The smoothing median confirms a change only once half its window holds it; the hold counted from
    # here measures how long the condition itself has lasted (lifecycle).
    held_since: float | None = None

    @property
    def fingerprint(self) -> str:
        """Stable identity of the subject."""
        return subject_fingerprint(self.kind, self.node, self.gpu, self.hpc_job, self.extra)


def subject_fingerprint(
    kind: AlertKind, node: str | None, gpu: int | None, hpc_job: str | None, extra: str = ""
) -> str:
    """Fingerprint of an alert subject; hpc_job only counts for job-keyed kinds."""
    return fingerprint(kind, node, gpu, hpc_job if kind.job_keyed else None, extra)


# Given an open alert's fingerprint: True = clear now, False = not clear (hold), None = no data to say.
ClearTest = Callable[[str], "bool | None"]


@dataclass(slots=True)
class Outcome:
    """What one detector says at one tick."""

    findings: dict[str, Finding] = field(default_factory=dict)
    clear: ClearTest = lambda fp: None

    def add(self, finding: Finding) -> None:
        """Record a finding under its fingerprint (evidence made JSON-plain: no numpy scalars)."""
        finding.evidence = plain(finding.evidence)
        self.findings[finding.fingerprint] = finding


def plain(value: Any) -> Any:
    """Evidence as plain Python values: numpy scalars to int/float/bool, NaN to None."""
    kind = type(value)
    if kind is float:
        return None if value != value else value
    if kind is int or kind is str or kind is bool or value is None:
        return value  # the common cases first: isinstance against the Mapping ABC is slow
    if kind is dict or isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and value != value:
        return None
    return value


def r3(x: float) -> float | None:
    """Round for evidence; NaN becomes None (unsupported, not 0)."""
    return None if x != x else round(float(x), EVIDENCE_DIGITS)


# A slot's entry before its first sync: no job code (-1 is "no job") is ever this.
_UNSYNCED = np.iinfo(np.int64).min


class FingerprintIndex:
    """fingerprint -> (slot, job code) for per-GPU alerts, kept across ticks and updated incrementally."""

    def __init__(self, kind: AlertKind) -> None:
        self.kind = kind
        self._keyed = kind.job_keyed
        self._map: dict[str, tuple[int, int]] = {}
        self._done = np.full(0, _UNSYNCED, dtype=np.int64)

    def get(self, windows: Any, fp: str) -> tuple[int, int] | None:
        """(slot, job code at the time) an open alert refers to, or None."""
        self._sync(windows)
        return self._map.get(fp)

    def prune(self, keep: set[str], max_per_slot: float) -> None:
        """Forget the fingerprints of jobs a GPU no longer runs, except those in `keep` (open alerts), once
        the index holds more than `max_per_slot` per GPU: a job-keyed index otherwise gains one entry each
        time any GPU starts another job, for good."""
        if len(self._map) > max_per_slot * len(self._done):
            self._map = {fp: (s, code) for fp, (s, code) in self._map.items() if fp in keep or self._done[s] == code}

    def _sync(self, w: Any) -> None:
        """Add fingerprints for new slots and slots that changed job."""
        n = w.n
        self._done = grown(self._done, n, _UNSYNCED)
        jobs = w.slot_job[:n] if self._keyed else np.full(n, -1, dtype=np.int64)
        for s in (self._done[:n] != jobs).nonzero()[0].tolist():
            code = int(jobs[s])
            job = w.job_names[code] if code >= 0 else None
            self._map[subject_fingerprint(self.kind, w.slot_node[s], w.slot_index[s], job)] = (s, code)
            self._done[s] = code
