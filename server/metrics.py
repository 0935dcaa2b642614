"""The server's Prometheus collector: active alerts, job health, and ingest/engine health.

Families are built fresh on every scrape from the runtime's published view and counters, so an
alert that resolves or a job that ends simply stops being exported.
"""

from __future__ import annotations

import math
import platform
from collections import Counter
from typing import Any, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpufleet.server import __version__
from gpufleet.server.alerts import AlertState, cause
from gpufleet.server.runtime import Runtime

# (metric suffix, JobHealth key, help) for per-job gauges; a key the engine does not report is skipped,
# and a list (the job's nodes, its stragglers) is exported as its length.
_JOB_GAUGES = (
    ("gpus", "gpus", "GPUs attributed to the job."),
    ("nodes", "nodes", "Nodes the job runs on."),
    ("stragglers", "stragglers", "GPUs or nodes currently flagged as stragglers holding the job back."),
    ("comm_bound", "comm_bound", "1 while the job is communication-bound, else 0."),
    ("input_bound", "input_bound", "1 while the job is input/host-bound, else 0."),
    ("comm_bound_ratio", "comm_bound_share", "Share of evaluated ticks the job was communication-bound (0-1)."),
    ("slowdown_ratio", "estimated_slowdown_ratio", "Estimated slowdown of the job against its own baseline (0-1)."),
    ("sm_active_ratio", "sm_active_ratio", "Mean SM activity of the job's GPUs (0-1)."),
    ("baseline_sm_active_ratio", "baseline_sm_active_ratio", "The job's own recent SM activity baseline (0-1)."),
    ("utilization_ratio", "utilization_ratio", "Mean NVML utilization of the job's GPUs (0-1)."),
    ("power_watts", "power_watts", "Mean power draw of the job's GPUs."),
)
# (metric name, NodeHealth key, help)
_NODE_GAUGES = (
    ("gpufleet_node_gpus", "gpus", "GPUs the engine tracks on the node."),
    ("gpufleet_node_reachable", "reachable", "1 while the node's samples keep arriving, else 0."),
    (
        "gpufleet_node_last_sample_timestamp_seconds",
        "last_sample_time",
        "Sample time of the newest snapshot the engine has from the node.",
    ),
    ("gpufleet_node_lag_seconds", "lag_seconds", "How far the node's newest sample trails the evaluation time."),
    ("gpufleet_node_open_alerts", "open_alerts", "Pending or firing alerts about the node."),
    (
        "gpufleet_node_gpus_unjudged",
        "unjudged_gpus",
        "Busy GPUs of the node that no peer group could judge at the last evaluation.",
    ),
)

# (metric name, EngineStats key, help) of the engine's own statistics; a counter's name gains _total.
_ENGINE_COUNTERS = (
    ("gpufleet_server_engine_samples_ingested", "samples_ingested", "GPU samples the engine took into its windows."),
    (
        "gpufleet_server_engine_late_samples_dropped",
        "late_samples_dropped",
        "GPU samples that came after their bin was evaluated.",
    ),
    ("gpufleet_server_engine_ticks", "ticks", "Evaluations (one per closed bin)."),
)
_ENGINE_GAUGES = (
    ("gpufleet_server_engine_pending_samples", "pending_samples", "Samples waiting for their bin to close."),
    ("gpufleet_server_engine_gpus", "gpus", "GPUs the engine tracks."),
    ("gpufleet_server_engine_nodes", "nodes", "Nodes the engine tracks."),
    ("gpufleet_server_engine_jobs", "jobs", "Jobs the engine has seen."),
    ("gpufleet_server_engine_open_alerts", "open_alerts", "Pending or firing alerts."),
    ("gpufleet_server_engine_firing_alerts", "firing_alerts", "Firing alerts."),
    (
        "gpufleet_server_gpus_unjudged",
        "gpus_unjudged",
        "Busy GPUs that no peer group could judge at the last evaluation (no straggler can be named among them).",
    ),
    (
        "gpufleet_server_engine_last_evaluation_timestamp_seconds",
        "last_tick_time",
        "Sample time of the end of the last bin the engine evaluated.",
    ),
)


class ServerCollector(Collector):
    """Reads a Runtime on every scrape; holds no metric state of its own."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def collect(self) -> Iterator[Metric]:
        """Every server family, freshly built."""
        info = GaugeMetricFamily(
            "gpufleet_server_build_info", "Always 1; the labels say what runs.", labels=["version", "python"]
        )
        info.add_metric([__version__, platform.python_version()], 1)
        yield info
        shard = GaugeMetricFamily(
            "gpufleet_server_shard_info",
            "Always 1; the part of the fleet this server judges (--shard INDEX/COUNT; 0/1: all of it).",
            labels=["index", "count"],
        )
        shard.add_metric([str(self.runtime.shard.index), str(self.runtime.shard.count)], 1)
        yield shard
        if self.runtime.shard.reads_every_jobless:
            yield GaugeMetricFamily(
                "gpufleet_server_shard_guest_gpus",
                "GPUs of no job this shard reads only to infer jobs over the whole fleet (--shard.jobless fleet); "
                "another shard publishes what is about them.",
                value=getattr(self.runtime.engine, "guest_gpus", 0),
            )
        yield from self._alerts()
        yield from self._jobs()
        yield from self._nodes()
        yield from self._ingest()
        yield from self._pipeline()
        yield from self._notifiers()

    def _alerts(self) -> Iterator[Metric]:
        """Counts of open alerts and one series per firing alert."""
        alerts = self.runtime.view.alerts
        counts = GaugeMetricFamily(
            "gpufleet_alerts", "Open (pending or firing) alerts.", labels=["kind", "severity", "state"]
        )
        for (kind, severity, state), n in sorted(
            Counter((a.kind.value, a.severity.value, a.state.value) for a in alerts).items()
        ):
            counts.add_metric([kind, severity, state], n)
        yield counts
        # The external labels are the same on every alert; namespace and pod are empty where not known.
        extra = list(self.runtime.routing.external_labels) + ["namespace", "pod"]
        active = GaugeMetricFamily(
            "gpufleet_alert_active",
            "1 for each firing alert, labelled by its subject and cause.",
            labels=["kind", "severity", "node", "gpu", "hpc_job", "alert_id", "cause", *extra],
        )
        for a in alerts:
            if a.state is AlertState.FIRING:
                active.add_metric(
                    [
                        a.kind.value,
                        a.severity.value,
                        a.node or "",
                        "" if a.gpu is None else str(a.gpu),
                        a.hpc_job or "",
                        a.id,
                        cause(a),
                        *(a.labels.get(name, "") for name in extra),
                    ],
                    1,
                )
        yield active

    def _jobs(self) -> Iterator[Metric]:
        """Per-job health gauges from the engine's JobHealth."""
        jobs = self.runtime.view.jobs
        for suffix, key, doc in _JOB_GAUGES:
            family = GaugeMetricFamily(f"gpufleet_job_{suffix}", doc, labels=["hpc_job"])
            for job in jobs:
                value = _number(job.get(key))
                if value is not None and job.get("hpc_job") is not None:
                    family.add_metric([str(job["hpc_job"])], value)
            yield family
        # A counter: what a job lost since the server started watching it. It starts again from 0 after a
        # restart, which Prometheus's increase() and rate() read as a counter reset.
        lost = CounterMetricFamily(
            "gpufleet_job_gpu_seconds_lost",
            "GPU-seconds the job lost while a straggler, input_bound or comm_bound alert of it "
            "fired, by that alert's kind.",
            labels=["hpc_job", "kind"],
        )
        for job in jobs:
            by_kind = job.get("gpu_hours_lost_by_kind")
            if job.get("hpc_job") is None or not isinstance(by_kind, dict):
                continue
            for kind, hours in sorted(by_kind.items()):
                value = _number(hours)
                if value is not None:
                    lost.add_metric([str(job["hpc_job"]), str(kind)], value * 3600)
        yield lost

    def _nodes(self) -> Iterator[Metric]:
        """Per-node gauges from the engine's NodeHealth."""
        nodes = self.runtime.view.nodes
        for name, key, doc in _NODE_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["node"])
            for node in nodes:
                value = _number(node.get(key))
                if value is not None and node.get("node") is not None:
                    family.add_metric([str(node["node"])], value)
            yield family

    def _ingest(self) -> Iterator[Metric]:
        """Per-target reachability and pull error counters."""
        source = self.runtime.source
        up = GaugeMetricFamily(
            "gpufleet_server_target_up", "1 if the last pull of the agent succeeded.", labels=["target"]
        )
        stale = GaugeMetricFamily(
            "gpufleet_server_target_stale", "1 if the agent answers but sends no new samples.", labels=["target"]
        )
        failures = GaugeMetricFamily(
            "gpufleet_server_target_consecutive_failures", "Failed pulls in a row for the agent.", labels=["target"]
        )
        last_ok = GaugeMetricFamily(
            "gpufleet_server_target_last_success_timestamp_seconds",
            "Wall-clock time of the last successful pull.",
            labels=["target"],
        )
        last_sample = GaugeMetricFamily(
            "gpufleet_server_target_last_sample_timestamp_seconds",
            "Sample time of the newest snapshot pulled from the agent.",
            labels=["target"],
        )
        offset = GaugeMetricFamily(
            "gpufleet_server_target_clock_offset_seconds",
            "The agent's clock minus the server's, as measured from its answers.",
            labels=["target"],
        )
        for h in source.health():
            up.add_metric([h.target], 1 if h.up else 0)
            if h.clock_offset_seconds is not None:
                offset.add_metric([h.target], h.clock_offset_seconds)
            stale.add_metric([h.target], 1 if h.stale else 0)
            failures.add_metric([h.target], h.consecutive_failures)
            if h.last_success is not None:
                last_ok.add_metric([h.target], h.last_success)
            if h.last_sample_time is not None:
                last_sample.add_metric([h.target], h.last_sample_time)
        yield from (up, stale, failures, last_ok, last_sample, offset)
        errors = CounterMetricFamily(
            "gpufleet_server_pull_errors",
            "Rejected pulls and snapshots by target and reason.",
            labels=["target", "reason"],
        )
        for (target, reason), n in sorted(source.errors.items()):
            errors.add_metric([target, reason], n)
        yield errors
        rejected = CounterMetricFamily(
            "gpufleet_server_rejected", "Rejected pulls and snapshots by reason.", labels=["reason"]
        )
        for reason, n in sorted(source.errors_by_reason().items()):
            rejected.add_metric([reason], n)
        yield rejected
        blind = CounterMetricFamily(
            "gpufleet_server_blind_cycles",
            "Cycles that gave the engine no usable GPU sample, by reason (no_series, "
            "all_rejected, all_targets_down, no_targets, source_down).",
            labels=["reason"],
        )
        for reason, n in sorted(source.blind_cycles.items()):
            blind.add_metric([reason], n)
        yield blind
        yield GaugeMetricFamily(
            "gpufleet_server_blind",
            "1 while the last cycle had no usable GPU sample, else 0.",
            value=1 if source.blind is not None else 0,
        )
        missing = GaugeMetricFamily(
            "gpufleet_server_source_reading_missing",
            "1 per reading no GPU of the source has (dcgm-exporter's stock counters) and "
            "detector that works without it as the effect label says.",
            labels=["reading", "detector", "effect"],
        )
        for reading, detector, effect in source.missing:
            missing.add_metric([reading, detector, effect], 1)
        yield missing
        yield CounterMetricFamily("gpufleet_server_pulls", "Pull attempts over all targets.", value=source.pulls_total)
        yield CounterMetricFamily(
            "gpufleet_server_samples_ingested",
            "Node snapshots accepted and fed to the engine.",
            value=source.samples_total,
        )
        last_cycle = source.last_cycle
        if last_cycle is not None:
            yield GaugeMetricFamily(
                "gpufleet_server_pull_cycle_duration_seconds",
                "Wall time of the last pull cycle over every target.",
                value=last_cycle.duration_seconds,
            )
            yield GaugeMetricFamily(
                "gpufleet_server_targets", "Targets in the last pull cycle.", value=last_cycle.targets
            )

    def _pipeline(self) -> Iterator[Metric]:
        """Engine cycle timing and counters, plus the engine's own numeric stats."""
        s = self.runtime.stats
        yield CounterMetricFamily("gpufleet_server_cycles", "Completed pull+engine cycles.", value=s.cycles_total)
        yield CounterMetricFamily("gpufleet_server_cycle_failures", "Cycles that raised.", value=s.cycle_failures_total)
        yield CounterMetricFamily(
            "gpufleet_server_cycle_overruns", "Cycles that took longer than the pull interval.", value=s.overruns_total
        )
        yield CounterMetricFamily(
            "gpufleet_server_alert_transitions", "Alert transitions from the engine.", value=s.transitions_total
        )
        yield CounterMetricFamily(
            "gpufleet_server_store_errors", "Failed alert store writes.", value=s.store_errors_total
        )
        yield GaugeMetricFamily(
            "gpufleet_server_store_unsaved_changes",
            "Alert changes and node names the store has not taken yet (retried every cycle).",
            value=s.store_unsaved_changes,
        )
        if s.store_unsaved_since is not None:
            yield GaugeMetricFamily(
                "gpufleet_server_store_unsaved_age_seconds",
                "How long the oldest unsaved alert change has waited for the store.",
                value=max(0.0, self.runtime.clock() - s.store_unsaved_since),
            )
        if s.tick_duration_seconds is not None:
            yield GaugeMetricFamily(
                "gpufleet_server_engine_tick_duration_seconds",
                "Wall time of the last engine ingest+advance.",
                value=s.tick_duration_seconds,
            )
        if s.last_tick is not None:
            yield GaugeMetricFamily(
                "gpufleet_server_engine_last_tick_timestamp_seconds",
                "Evaluation time of the last engine tick.",
                value=s.last_tick,
            )
        dropped = CounterMetricFamily(
            "gpufleet_server_samples_dropped",
            "Snapshots the engine dropped, by reason (too_old: older than its window "
            "before now or behind its node's newest sample).",
            labels=["reason"],
        )
        too_old = _number(self.runtime.view.stats.get("too_old_snapshots_dropped"))
        if too_old is not None:
            dropped.add_metric(["too_old"], too_old)
        yield dropped
        yield from _engine_stats(self.runtime.view.stats)

    def _notifiers(self) -> Iterator[Metric]:
        """Delivery counters per notifier."""
        labels = ["notifier", "url"]  # several Alertmanagers: one notifier each
        sent = CounterMetricFamily("gpufleet_server_notifications_sent", "Alerts delivered.", labels=labels)
        failed = CounterMetricFamily(
            "gpufleet_server_notifications_failed", "Alerts not delivered after retries.", labels=labels
        )
        dropped = CounterMetricFamily(
            "gpufleet_server_notifications_dropped", "Alerts dropped from a full queue.", labels=labels
        )
        for n in self.runtime.notifiers:
            sent.add_metric([n.name, n.url], n.sent_total)
            failed.add_metric([n.name, n.url], n.failed_total)
            dropped.add_metric([n.name, n.url], n.dropped_total)
        yield from (sent, failed, dropped)


def _engine_stats(stats: dict[str, Any]) -> Iterator[Metric]:
    """The engine's own statistics, each as its type: counters, gauges, the time of its last evaluation
    (too_old_snapshots_dropped is gpufleet_server_samples_dropped_total{reason="too_old"})."""
    for family, table in ((CounterMetricFamily, _ENGINE_COUNTERS), (GaugeMetricFamily, _ENGINE_GAUGES)):
        for name, key, doc in table:
            number = _number(stats.get(key))
            if number is not None:
                yield family(name, doc, value=number)


def _number(value: Any) -> float | None:
    """A finite number (bools as 0/1, lists as their length), or None for anything else."""
    if isinstance(value, (list, tuple)):
        return float(len(value))
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def build_registry(runtime: Runtime) -> CollectorRegistry:
    """A fresh registry holding only the server collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServerCollector(runtime))
    return registry
