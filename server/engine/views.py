"""Read-only views of the engine for the API and /metrics: per job, per node, and the engine itself."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class JobHealth:
    """One hpc_job at the latest evaluation."""

    hpc_job: str
    gpus: int
    nodes: tuple[str, ...]
    utilization_ratio: float | None
    sm_active_ratio: float | None
    baseline_sm_active_ratio: float | None
    power_watts: float | None
    estimated_slowdown_ratio: float | None
    stragglers: tuple[dict, ...]  # {"node": ..., "gpu": ... or None}
    comm_bound: bool
    input_bound: bool
    comm_bound_share: float  # share of evaluated ticks the job was comm-bound
    evaluated_ticks: int
    # (kind, GPU-hours) lost while that kind's alert fired for the job, since the engine first saw it
    gpu_hours_lost_by_kind: tuple[tuple[str, float], ...] = ()

    @property
    def gpu_hours_lost(self) -> float:
        """GPU-hours lost, every kind together."""
        return round(sum(hours for _, hours in self.gpu_hours_lost_by_kind), 4)

    def to_dict(self) -> dict[str, Any]:
        """JSON shape."""
        d = asdict(self)
        d["nodes"] = list(self.nodes)
        d["stragglers"] = [dict(s) for s in self.stragglers]
        d["gpu_hours_lost"] = self.gpu_hours_lost
        d["gpu_hours_lost_by_kind"] = dict(self.gpu_hours_lost_by_kind)
        return d


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeHealth:
    """One node at the latest evaluation."""

    node: str
    gpus: int
    reachable: bool
    last_sample_time: float | None
    lag_seconds: float | None
    hpc_jobs: tuple[str, ...]
    open_alerts: int
    # Busy GPUs no peer group could judge at the latest evaluation (see engine.unjudged).
    unjudged_gpus: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON shape."""
        d = asdict(self)
        d["hpc_jobs"] = list(self.hpc_jobs)
        return d


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStats:
    """The engine's own health."""

    samples_ingested: int
    late_samples_dropped: int
    too_old_snapshots_dropped: int
    pending_samples: int
    ticks: int
    last_tick_time: float | None
    gpus: int
    nodes: int
    jobs: int
    open_alerts: int
    firing_alerts: int
    # Busy GPUs no peer group could judge at the latest evaluation, fleet-wide.
    gpus_unjudged: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON shape."""
        return asdict(self)
