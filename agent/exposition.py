"""Prometheus exposition of one snapshot: families built fresh from the snapshot on every render.

`families()` is the single definition of what is exported; the families of the per-GPU readings are
the reading table's (agent.readings), the rest are written here. Two sinks consume it: `SnapshotCollector`
(a prometheus_client custom collector, for a fresh CollectorRegistry and generate_latest) and
`Renderer`, which writes the same text format byte for byte, but remembers each series' rendered name
and labels between snapshots, as node_exporter builds its descriptors once (agent.render_on_demand runs
it only for the snapshots a scrape reads). generate_latest re-validates
and re-escapes every label of every sample (about 7 ms for an 8-GPU node with per-link NVLink); the
Renderer only formats values, which keeps the agent's whole CPU budget under half a percent.
"""

from __future__ import annotations

import math
from math import isfinite
from dataclasses import dataclass, field
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from gpufleet.agent.activity import NO_TOTALS, ActivityTotals
from gpufleet.agent.health import AgentHealth
from gpufleet.agent.model import GpuSample, NodeSnapshot, ThrottleReason
from gpufleet.agent.part_families import mig_families, process_family
from gpufleet.agent.readings import READINGS, exported_families, family_name

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
GPU_LABELS = ("node", "gpu", "uuid", "model")
NODE_LABEL = ("node",)

_Fields = tuple[tuple[str, str], ...]


def _table_families() -> tuple[tuple[str, str, str, str, _Fields], ...]:
    """(name, help, kind, label, ((label value, GpuSample field), ...)) of each family of the reading table."""
    families = exported_families()
    fields: dict[str, list[tuple[str, str]]] = {f.name: [] for f in families}
    for reading in READINGS:
        name = family_name(reading)
        if name is not None:
            fields[name].append((reading.label_value, reading.name))
    return tuple((f.name, f.help, f.kind, f.label, tuple(fields[f.name])) for f in families)


# The per-GPU families of agent.readings, each series one reading. Metrics are data, not code.
TABLE_FAMILIES = _table_families()

# counter_as_named: a counter served under a name of someone else's that lacks _total (dcgm-exporter's).
_SUFFIX = {
    "counter": ("_total", "counter"),
    "counter_as_named": ("", "counter"),
    "info": ("_info", "gauge"),
    "gauge": ("", "gauge"),
}


@dataclass(slots=True)
class Family:
    """One metric family: rows of (label names, label values, value); names are shared tuples."""

    name: str
    kind: str  # gauge | counter | counter_as_named | info
    help: str
    rows: list[tuple[tuple[str, ...], tuple[str, ...], float]] = field(default_factory=list)

    def add(self, names: tuple[str, ...], values: tuple[str, ...], value: float) -> None:
        self.rows.append((names, values, value))


def families(snapshot: NodeSnapshot | None, health: AgentHealth, activity: ActivityTotals = NO_TOTALS) -> list[Family]:
    """Every family with at least one series: agent health, then GPUs while NVML is up (activity: the
    sampler's running totals up to this snapshot, agent.activity)."""
    out = list(_agent_families(snapshot, health))
    if snapshot is not None and health.nvml_up:
        out.extend(_gpu_families(snapshot, health, activity))
    # A family without rows would still print HELP/TYPE; an absent reading should leave no trace.
    return [f for f in out if f.rows]


FamiliesFn = Callable[[NodeSnapshot | None, AgentHealth, ActivityTotals], list[Family]]
_GPUFLEET_FAMILIES: FamiliesFn = families  # Renderer's `families` argument hides the function's name


def agent_families(snapshot: NodeSnapshot | None, health: AgentHealth) -> list[Family]:
    """The agent's own health families alone, for an exposition that names the GPUs' series otherwise."""
    return [f for f in _agent_families(snapshot, health) if f.rows]


class Renderer:
    """Writes families as text format 0.0.4, caching each series' `name{labels}` across renders.

    `families` decides what is exported: gpufleet's names (`families`) or another's
    (agent.dcgm_names.DcgmFamilies)."""

    MAX_CACHED = 50_000  # a few thousand series per node; the bound only guards against label churn

    def __init__(self, process_metrics: bool = False, families: FamiliesFn | None = None) -> None:
        self._families_of: FamiliesFn = families or _GPUFLEET_FAMILIES
        self._series: dict[tuple[str, tuple[str, ...], tuple[str, ...]], str] = {}
        self._headers: dict[tuple[str, str], str] = {}
        # The agent's own process_* families (CPU seconds, RSS, start time, fds), as every exporter has,
        # read when a body is rendered: a registry of this renderer's own, never the global REGISTRY.
        self._process: CollectorRegistry | None = None
        if process_metrics:
            self._process = CollectorRegistry(auto_describe=False)
            ProcessCollector(registry=self._process)
        # Family -> its rows and text last time: limits, identity and capabilities rarely change, and
        # comparing rows costs far less than formatting them again.
        self._families: dict[tuple[str, str], tuple[list, str]] = {}

    def render(self, snapshot: NodeSnapshot | None, health: AgentHealth, activity: ActivityTotals = NO_TOTALS) -> bytes:
        """The whole exposition but the per-scrape sample age; once per publication, never per scrape."""
        if len(self._series) > self.MAX_CACHED:
            self._series.clear()
        out: list[str] = []
        cached = self._families
        for fam in self._families_of(snapshot, health, activity):
            key = (fam.name, fam.kind)
            last = cached.get(key)
            if last is not None and last[0] == fam.rows:
                out.append(last[1])
                continue
            text = self._family_text(fam)
            cached[key] = (fam.rows, text)
            out.append(text)
        body = "".join(out).encode("utf-8")
        if self._process is not None:
            body += generate_latest(self._process)
        return body

    def _family_text(self, fam: Family) -> str:
        header = self._headers.get((fam.name, fam.kind))
        if header is None:
            header = self._headers[(fam.name, fam.kind)] = _header(fam)
        out = [header]
        series, fmt = self._series, _format_value
        for names, values, value in fam.rows:
            key = (fam.name, names, values)
            prefix = series.get(key)
            if prefix is None:
                prefix = series[key] = _series_text(fam, names, values)
            out.append(f"{prefix}{fmt(value)}\n")
        return "".join(out)


def render(snapshot: NodeSnapshot | None, health: AgentHealth, activity: ActivityTotals = NO_TOTALS) -> bytes:
    """One-off render (no cache kept); the sampler holds a Renderer instead."""
    return Renderer().render(snapshot, health, activity)


def render_reference(snapshot: NodeSnapshot | None, health: AgentHealth, activity: ActivityTotals = NO_TOTALS) -> bytes:
    """The same exposition through a fresh registry and prometheus_client's generate_latest."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshot, health, activity))
    return generate_latest(registry)


def render_age(now: float, snapshot: NodeSnapshot | None, node: str) -> bytes:
    """The one family that changes per scrape, appended to the pre-rendered body; empty without a sample."""
    if snapshot is None:
        return b""
    age = max(0.0, now - snapshot.time)
    return (
        "# HELP gpufleet_agent_sample_age_seconds Seconds since the newest sample was taken.\n"
        "# TYPE gpufleet_agent_sample_age_seconds gauge\n"
        f'gpufleet_agent_sample_age_seconds{{node="{_escape(node)}"}} {floatToGoString(age)}\n'
    ).encode()


class SnapshotCollector:
    """prometheus_client custom collector over one snapshot; holds no state between collects."""

    def __init__(
        self, snapshot: NodeSnapshot | None, health: AgentHealth, activity: ActivityTotals = NO_TOTALS
    ) -> None:
        self._snapshot = snapshot
        self._health = health
        self._activity = activity

    def collect(self) -> Iterator[Metric]:
        """Fresh prometheus_client families, one per Family."""
        for fam in families(self._snapshot, self._health, self._activity):
            if fam.kind == "info":
                info = InfoMetricFamily(fam.name, fam.help)
                for names, values, _ in fam.rows:
                    info.add_metric([], dict(zip(names, values)))
                yield info
                continue
            cls = CounterMetricFamily if fam.kind == "counter" else GaugeMetricFamily
            label_names = fam.rows[0][0]
            metric = cls(fam.name, fam.help, labels=list(label_names))
            for _, values, value in fam.rows:
                metric.add_metric(list(values), value)
            yield metric


# --- the families ------------------------------------------------------------------------------------


def _agent_families(snap: NodeSnapshot | None, health: AgentHealth) -> Iterator[Family]:
    node = (health.node,)
    yield _one(
        "gpufleet_agent_nvml_up", "gauge", "1 when NVML is initialised and answering.", node, float(health.nvml_up)
    )
    yield _one("gpufleet_agent_build", "info", "Agent build.", node + (health.version,), 1.0, ("node", "version"))
    yield _one(
        "gpufleet_agent_sample_cycles", "counter", "Sampling cycles attempted.", node, float(health.cycles_total)
    )
    errors = Family("gpufleet_agent_errors", "counter", "Errors by reading and kind, since start.")
    for (reading, error), count in sorted(health.errors.items()):
        errors.add(("node", "reading", "error"), (health.node, reading, error), float(count))
    yield errors
    cost = Family(
        "gpufleet_agent_nvml_seconds",
        "counter",
        "Thread CPU time the agent spent inside each NVML function, since start.",
    )
    for call, seconds in sorted(health.nvml_seconds.items()):
        cost.add(("call", "node"), (call, health.node), seconds)
    yield cost
    if health.nvml_up:
        periods = Family(
            "gpufleet_agent_reading_period_seconds",
            "gauge",
            "Seconds between reads of each NVML reading, fitted to --sampling.cpu-budget at start.",
        )
        for reading, seconds in sorted(health.reading_periods.items()):
            periods.add(("node", "reading"), (health.node, reading), seconds)
        yield periods
    if snap is not None:
        yield _one(
            "gpufleet_agent_last_sample_timestamp_seconds", "gauge", "Unix time of the newest sample.", node, snap.time
        )
        if snap.sample_duration_seconds is not None:
            yield _one(
                "gpufleet_agent_sample_duration_seconds",
                "gauge",
                "Seconds the newest sampling cycle took.",
                node,
                snap.sample_duration_seconds,
            )


def _gpu_families(snap: NodeSnapshot, health: AgentHealth, activity: ActivityTotals) -> Iterator[Family]:
    ids = {g.index: (snap.node, str(g.index), g.uuid, g.model) for g in snap.gpus}
    up = Family("gpufleet_gpu_up", "gauge", "1 when the GPU answers NVML, 0 when it is lost.")
    for g in snap.gpus:
        up.add(GPU_LABELS, ids[g.index], float(g.up))
    yield up
    yield _info_family(snap, ids)
    yield _job_family(snap)
    yield _pod_family(snap)
    for name, help_text, kind, label, fields in TABLE_FAMILIES:
        yield _labelled(name, help_text, kind, label, fields, snap.gpus, ids)
    yield from _activity_families(snap.gpus, ids, activity)
    yield _throttle_reason_family(snap.gpus, ids)
    yield _throttle_seconds_family(snap.gpus, ids)
    yield _nvlink_link_family(snap.gpus, ids)
    yield _xid_family(snap.gpus, ids)
    yield _xid_events_family(snap.gpus, ids)
    yield _unsupported_family(health, ids)
    for name, kind, help_text, rows in (
        *mig_families(snap.gpus, ids, GPU_LABELS),
        process_family(snap.gpus, ids, GPU_LABELS),
    ):
        yield Family(name, kind, help_text, rows)


_Ids = dict[int, tuple[str, str, str, str]]


def _labelled(
    name: str,
    help_text: str,
    kind: str,
    label: str,
    fields: tuple[tuple[str, str], ...],
    gpus: tuple[GpuSample, ...],
    ids: _Ids,
) -> Family:
    fam = Family(name, kind, help_text)
    rows = fam.rows
    names = GPU_LABELS + ((label,) if label else ())
    extras = [(attr, (label_value,) if label else ()) for label_value, attr in fields]
    for g in gpus:
        for attr, extra in extras:
            value = getattr(g, attr)
            if value is not None and isfinite(value):
                rows.append((names, ids[g.index] + extra, float(value)))
    return fam


def _info_family(snap: NodeSnapshot, ids: _Ids) -> Family:
    fam = Family("gpufleet_gpu", "info", "GPU identity and driver; value is always 1.")
    for g in snap.gpus:
        extra = (
            ("pci_bus_id", g.pci_bus_id),
            ("serial", g.serial),
            ("vbios_version", g.vbios_version),
            ("driver_version", snap.driver_version),
        )
        present = [(k, v) for k, v in extra if v]
        fam.add(GPU_LABELS + tuple(k for k, _ in present), ids[g.index] + tuple(v for _, v in present), 1.0)
    return fam


def _job_family(snap: NodeSnapshot) -> Family:
    fam = Family(
        "gpufleet_gpu_job",
        "info",
        "HPC job using the GPU; a separate series so job churn does not multiply the others.",
    )
    for g in snap.gpus:
        if g.hpc_job:
            fam.add(("node", "gpu", "uuid", "hpc_job"), (snap.node, str(g.index), g.uuid, g.hpc_job), 1.0)
    return fam


def _pod_family(snap: NodeSnapshot) -> Family:
    fam = Family(
        "gpufleet_gpu_pod", "info", "Kubernetes pod using the GPU, to join with kube-state-metrics on (namespace, pod)."
    )
    for g in snap.gpus:
        if g.kubernetes_namespace and g.kubernetes_pod:
            fam.add(
                ("node", "gpu", "uuid", "namespace", "pod"),
                (snap.node, str(g.index), g.uuid, g.kubernetes_namespace, g.kubernetes_pod),
                1.0,
            )
    return fam


_REASON_LABELS = GPU_LABELS + ("reason",)
_READING_LABELS = GPU_LABELS + ("reading",)


def _activity_families(gpus: tuple[GpuSample, ...], ids: _Ids, activity: ActivityTotals) -> Iterator[Family]:
    active = Family(
        "gpufleet_gpu_active_seconds",
        "counter",
        "Activity ratio (reading: utilization, sm_active) integrated over sampled time; the increase "
        "over the increase of gpufleet_gpu_active_sampled_seconds_total is the exact mean between "
        "two scrapes, which a scraped ratio gauge (one sampling interval's mean) is not.",
    )
    sampled = Family(
        "gpufleet_gpu_active_sampled_seconds",
        "counter",
        "Sampled time behind gpufleet_gpu_active_seconds_total, per reading.",
    )
    for g in gpus:
        for reading, (active_seconds, sampled_seconds) in sorted(activity.get(g.uuid, {}).items()):
            active.add(_READING_LABELS, ids[g.index] + (reading,), active_seconds)
            sampled.add(_READING_LABELS, ids[g.index] + (reading,), sampled_seconds)
    yield active
    yield sampled


def _throttle_reason_family(gpus: tuple[GpuSample, ...], ids: _Ids) -> Family:
    fam = Family(
        "gpufleet_gpu_throttle_active",
        "gauge",
        "1 while the named clocks-event (throttle) reason is active, 0 otherwise.",
    )
    for g in gpus:
        if g.throttle_reasons is not None:
            for reason in ThrottleReason:
                fam.add(_REASON_LABELS, ids[g.index] + (reason.label,), float(bool(g.throttle_reasons & reason)))
    return fam


def _throttle_seconds_family(gpus: tuple[GpuSample, ...], ids: _Ids) -> Family:
    fam = Family("gpufleet_gpu_throttle_seconds", "counter", "Time spent in each clocks-event reason.")
    for g in gpus:
        for reason, seconds in sorted(g.throttle_seconds_total.items()):
            if _present(seconds):
                fam.add(_REASON_LABELS, ids[g.index] + (reason,), float(seconds))
    return fam


def _nvlink_link_family(gpus: tuple[GpuSample, ...], ids: _Ids) -> Family:
    fam = Family("gpufleet_gpu_nvlink_link_bytes", "counter", "NVLink data bytes per link.")
    names = GPU_LABELS + ("link", "direction")
    rows = fam.rows
    for g in gpus:
        gpu_ids = ids[g.index]
        for direction, links in (("tx", g.nvlink_link_tx_bytes_total), ("rx", g.nvlink_link_rx_bytes_total)):
            for link, value in enumerate(links):
                if value is not None and isfinite(value):
                    rows.append((names, gpu_ids + (str(link), direction), float(value)))
    return fam


def _xid_family(gpus: tuple[GpuSample, ...], ids: _Ids) -> Family:
    fam = Family("gpufleet_gpu_xid_errors", "counter", "XID events seen since the agent started, by code.")
    names = GPU_LABELS + ("xid",)
    for g in gpus:
        for code, count in sorted(g.xid_errors_by_code.items()):
            fam.add(names, ids[g.index] + (str(code),), float(count))
    return fam


def _xid_events_family(gpus: tuple[GpuSample, ...], ids: _Ids) -> Family:
    # One series per GPU from the start (0 until the first event), so increase() counts the first XID too;
    # absent where the GPU delivers no XID events.
    fam = Family(
        "gpufleet_gpu_xid_events",
        "counter",
        "XID events of any code seen since the agent started; 0 from the start where the GPU "
        "delivers XID events (per code: gpufleet_gpu_xid_errors_total).",
    )
    for g in gpus:
        if _present(g.xid_errors_total):
            fam.add(GPU_LABELS, ids[g.index], float(g.xid_errors_total))  # type: ignore[arg-type]
    return fam


def _unsupported_family(health: AgentHealth, ids: _Ids) -> Family:
    # Only what a user acts on: a reading the GPU does not have. Supported ones leave no series, which
    # keeps an 8-GPU node's scrape about 40 % smaller than one series per reading.
    fam = Family(
        "gpufleet_gpu_reading_unsupported",
        "gauge",
        "1 for each reading the GPU does not support (probed when NVML opens); no series otherwise.",
    )
    names = GPU_LABELS + ("reading",)
    for index, readings in sorted(health.capabilities.items()):
        if index in ids:
            for reading, supported in sorted(readings.items()):
                if not supported:
                    fam.add(names, ids[index] + (reading,), 1.0)
    return fam


def _one(
    name: str, kind: str, help_text: str, values: tuple[str, ...], value: float, names: tuple[str, ...] = NODE_LABEL
) -> Family:
    fam = Family(name, kind, help_text)
    fam.add(names, values, value)
    return fam


# --- text format ---------------------------------------------------------------------------------------


def _header(fam: Family) -> str:
    suffix, kind = _SUFFIX[fam.kind]
    doc = fam.help.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {fam.name}{suffix} {doc}\n# TYPE {fam.name}{suffix} {kind}\n"


def _series_text(fam: Family, names: tuple[str, ...], values: tuple[str, ...]) -> str:
    """`name{a="x",b="y"} ` with labels sorted by name, as generate_latest writes them."""
    suffix = _SUFFIX[fam.kind][0]
    pairs = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(zip(names, values)))
    return f"{fam.name}{suffix}{{{pairs}}} " if pairs else f"{fam.name}{suffix} "


def _format_value(value: float) -> str:
    """floatToGoString's output; Python's repr is already Go's below 1e6 (values here are finite)."""
    return repr(value) if value < 1e6 else floatToGoString(value)


def _present(value: object) -> bool:
    """Unsupported is None; a NaN or infinity that slipped through is treated as absent too."""
    if value is None or isinstance(value, str):
        return False
    return math.isfinite(float(value))  # type: ignore[arg-type]


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
