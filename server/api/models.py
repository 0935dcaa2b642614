"""Response models: the OpenAPI schema documents the API through these."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gpufleet.server.alerts import Alert, AlertState, IncidentRole, Severity


class AlertModel(BaseModel):
    """One alert occurrence (times are Unix seconds of sample time)."""

    id: str = Field(description="Unique per occurrence: fingerprint + when it went pending.")
    fingerprint: str = Field(description="Stable identity of the subject; repeats across occurrences.")
    kind: str = Field(
        description="What the problem is, as its detector names it: thermal_throttle, straggler, comm_bound, "
        "input_bound, node_unreachable, gpu_lost, xid, ecc (docs/detection.md), or a kind a detector added "
        "declares."
    )
    severity: Severity
    state: AlertState
    node: str | None = Field(
        description="Node name; null for job-level alerts; an agent's HOST:PORT for "
        "node_unreachable about an agent never heard from."
    )
    gpu: int | None = Field(description="GPU index on the node; null for node- and job-level alerts.")
    uuid: str | None = Field(description="GPU UUID when the alert is about one GPU.")
    hpc_job: str | None = Field(description="Scheduler job id the subject belongs to, if known.")
    pending_since: float
    started: float | None = Field(description="When it began firing; null while pending.")
    resolved: float | None
    updated: float
    summary: str
    description: str = Field(
        description="One line for a person: the summary, where it is (node, GPU, job, pod) and what to look at."
    )
    advice: str = Field("", description="What to do, as the alert's kind says (the second half of the description).")
    cause: str = Field(
        description="The short why, from a fixed vocabulary joined by '+': a straggler's pattern "
        "and what cut its clocks, what made a GPU thermal, an XID's code; empty "
        "where the kind says it all.",
        examples=["gpu_clocks_cut+hw_slowdown_or_power_brake"],
    )
    labels: dict[str, str] = Field(
        description="Routing labels: the server's configured external labels "
        "(--alert.external-labels) and, on Kubernetes, the namespace and "
        "pod of the subject where all its GPUs agree on them.",
        examples=[{"cluster": "eu-1", "namespace": "research", "pod": "llama-worker-3"}],
    )
    runbook_url: str | None = Field(
        description="Link from --alert.runbook-url for this alert; null when not configured."
    )
    evidence: dict[str, Any] = Field(description="The numbers that triggered it, against peers or baseline.")
    incident: str | None = Field(
        None,
        description="The incident it belongs to: the alert id of its cause (its own id where it is the cause). "
        "Null where nothing grouped it.",
    )
    role: IncidentRole | None = Field(
        None, description="cause: what pages; effect: explained by its incident's cause (docs/server.md, Incidents)."
    )

    @classmethod
    def of(cls, alert: Alert) -> "AlertModel":
        """From the engine's Alert value."""
        return cls.model_validate(alert.to_dict())


class IncidentModel(BaseModel):
    """Open alerts that share a cause: the cause, and the alerts it explains."""

    id: str = Field(description="The incident's id: its cause's alert id.")
    cause: AlertModel | None = Field(
        description="What pages. Resolved while effects of it stay open (they stay in its incident until they "
        "resolve); null where the store no longer holds it."
    )
    effects: list[AlertModel] = Field(description="Alerts explained by the cause, oldest first.")


class ShardModel(BaseModel):
    """A part of a sharded fleet (`--shard INDEX/COUNT`); 0 of 1 is the whole fleet."""

    index: int = 0
    count: int = 1


class PeerErrorModel(BaseModel):
    """A peer shard (`--shard.peers`) that gave no usable answer to a fleet view."""

    peer: str = Field(description="The URL asked.")
    error: str


class ShardedModel(BaseModel):
    """Which shard answers, and for a fleet view (`?scope=fleet`) which shards' parts it holds."""

    shard: ShardModel = Field(default_factory=ShardModel, description="The shard of the server that answers.")
    scope: Literal["shard", "fleet"] = Field(
        default="shard", description="shard: this server's own part; fleet: every shard's that answered."
    )
    shards_missing: list[int] = Field(
        default_factory=list,
        description="Fleet view: indexes of the shards whose part is missing because no peer answered for them.",
    )
    peer_errors: list[PeerErrorModel] = Field(default_factory=list, description="Fleet view: peers that failed.")


class IncidentListModel(ShardedModel):
    """The open incidents, newest cause first."""

    incidents: list[IncidentModel]


class AlertPageModel(ShardedModel):
    """A page of alerts, newest first."""

    alerts: list[AlertModel]
    total: int = Field(description="Alerts matching the filters, over all pages.")
    limit: int
    offset: int
    next_offset: int | None = Field(description="Offset of the next page; null on the last page.")


class StragglerRef(BaseModel):
    """A GPU (or a whole node: gpu null) holding its job back."""

    node: str | None = None
    gpu: int | None = None


class JobModel(BaseModel):
    """Health of one job as of the engine's latest evaluation (ratios 0-1; null = unknown)."""

    model_config = ConfigDict(extra="allow")
    hpc_job: str | None = None
    gpus: int | None = None
    nodes: list[str] = Field(default_factory=list)
    utilization_ratio: float | None = None
    sm_active_ratio: float | None = None
    baseline_sm_active_ratio: float | None = Field(None, description="The job's own recent SM activity baseline.")
    power_watts: float | None = None
    estimated_slowdown_ratio: float | None = Field(
        None,
        description=(
            "The job's step-time slowdown now (0-1): how far its GPUs' SM activity (power where that is not "
            "reported) sits below the job's own baseline at evaluated_at. A straggler alert's 'loses ~N % per step' "
            "is another figure: the slowdown put down to its culprit GPU or node, estimated from it against its "
            "peers as the alert fired."
        ),
    )
    stragglers: list[StragglerRef] = Field(default_factory=list)
    comm_bound: bool | None = None
    input_bound: bool | None = None
    comm_bound_share: float | None = Field(None, description="Share of evaluated ticks spent communication-bound.")
    evaluated_ticks: int | None = None
    gpu_hours_lost: float | None = Field(
        None,
        description="GPU-hours the job lost while a straggler, input_bound or "
        "comm_bound alert of it fired, since the engine first saw it.",
    )
    gpu_hours_lost_by_kind: dict[str, float] = Field(
        default_factory=dict, description="gpu_hours_lost by the kind of alert it is put down to."
    )


class NodeModel(BaseModel):
    """One node as of the engine's latest evaluation."""

    model_config = ConfigDict(extra="allow")
    node: str | None = None
    gpus: int | None = None
    reachable: bool | None = None
    last_sample_time: float | None = None
    lag_seconds: float | None = Field(None, description="How far its newest sample trails the evaluation time.")
    hpc_jobs: list[str] = Field(default_factory=list)
    open_alerts: int | None = None
    unjudged_gpus: int | None = Field(
        None, description="Busy GPUs of the node no peer group could judge: no straggler can be named among them."
    )


class TargetModel(BaseModel):
    """One agent the server pulls, and how that is going."""

    target: str = Field(description="HOST:PORT of the agent.")
    node: str | None = Field(description="Node name the agent reported.")
    up: bool = Field(description="The last pull succeeded.")
    stale: bool = Field(description="The agent answers but has sent no new sample for a while.")
    last_attempt: float | None
    last_success: float | None
    last_sample_time: float | None = Field(
        description="Sample time of the newest snapshot received, in the agent's clock."
    )
    consecutive_failures: int
    last_error: str | None
    clock_offset_seconds: float | None = Field(
        None,
        description=(
            "The agent's clock minus the server's, measured from its answers; taken out of its sample times once "
            "it reaches --pull.clock-offset-min."
        ),
    )


class JobsModel(ShardedModel):
    """Every job the engine currently tracks."""

    jobs: list[JobModel]
    evaluated_at: float | None = Field(description="Time of the engine evaluation these figures come from.")


class NodesModel(ShardedModel):
    """Every node the engine tracks, and every configured agent target."""

    nodes: list[NodeModel]
    targets: list[TargetModel]
    evaluated_at: float | None
    unjudged_gpus: int = Field(0, description="Busy GPUs, fleet-wide, no peer group could judge.")


class HealthModel(BaseModel):
    """Liveness and a short summary of the pipeline."""

    status: Literal["ok", "starting", "degraded"]
    targets: int
    targets_up: int
    cycles: int
    last_tick: float | None
    open_alerts: int
    # Why the status is degraded: "stalled" (cycles stopped completing), "store_unsaved", "store_error" (a store
    # read or write fails) or the ingest's blindness reason (no_series, all_rejected, all_targets_down,
    # no_targets, source_down), with what it looked for and found, or "targets_never_answered" with each
    # such target's last error.
    degraded_reason: str | None = None
    degraded_detail: str | None = None
    targets_never_answered: list[str] = Field(
        default_factory=list, description="Targets tried and never heard from (a typo'd host, a closed port)."
    )
    store_unsaved_changes: int = Field(
        0,
        description="Alert changes the store has not taken yet (a failed "
        "write, retried every cycle); degraded while above 0.",
    )
    store_unsaved_age_seconds: float | None = Field(
        None, description="How long the oldest of them has waited; null while none waits."
    )


class ErrorModel(BaseModel):
    """An error answer."""

    detail: str
