"""NVIDIA dcgm-exporter's series as snapshot-contract readings: names, labels and units, as data.

dcgm-exporter names a metric after its DCGM field (`DCGM_FI_DEV_GPU_TEMP`) and labels each GPU's series
`gpu` (index), `UUID`, `modelName`, `Hostname`, `pci_bus_id`, `device`, with `hpc_job` where HPC job
mapping is on and `namespace`/`pod`/`container` where Kubernetes pod mapping is (a GPU's job: job_of). Its units are the
fields' own: %, MHz, MiB, mJ; the contract's are ratios, Hz, bytes, J.

What the shipped counter files (etc/default-counters.csv, etc/dcp-metrics-included.csv) leave out, a site
can add to its own file: the fields read beyond them are marked so in the reading table (server/readings.py,
DcgmField.shipped), and a detector that needs a reading no GPU has says what it cannot do
(MISSING_EFFECTS), once, where the source reports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from gpufleet import pod_jobs
from gpufleet.server import readings
from gpufleet.server.engine import registry


@dataclass(frozen=True, slots=True)
class Reading:
    """One dcgm-exporter metric read as one contract field: value x scale, in the contract's unit."""

    field: str
    scale: float = 1.0
    # Where two metrics give one field, the higher rank wins (the finer reading, or the newer field name).
    rank: int = 0
    counter: bool = False  # grows without bound (energy, error counts): only 64-bit blanks apply

    def value(self, raw: float) -> float | None:
        """The reading in the contract's unit, or None where DCGM wrote a blank (unsupported) instead."""
        if raw != raw or raw >= (_BLANK_64 if self.counter else _BLANK_32):
            return None
        return raw * self.scale


# DCGM writes a reading it does not have (blank, not found, not supported, no permission) as a sentinel
# just below its type's maximum, which dcgm-exporter exports as that number: from 0x7ffffff0 for 32-bit
# integers, from 2**47 for doubles, from 0x7ffffffffffffff0 for 64-bit integers (a GPU without an HBM
# sensor reads DCGM_FI_DEV_MEMORY_TEMP 9223372036854775794). Every gauge read here is far below 0x7ffffff0;
# the counters can pass it, but not 2**47 (mJ: 700 W for six years).
_BLANK_32 = float(0x7FFFFFF0)
_BLANK_64 = float(2**47)


def dcgm_readings(table: tuple[readings.Reading, ...]) -> dict[str, Reading]:
    """dcgm-exporter metric -> how it is read, from the reading table's dcgm-exporter fields."""
    return {
        f.metric: Reading(r.name, f.scale, f.rank, counter=r.kind is readings.Kind.COUNTER)
        for r in table
        for f in r.dcgm
    }


READINGS: Mapping[str, Reading] = MappingProxyType(dcgm_readings(readings.READINGS))
BOOLS = frozenset(r.name for r in readings.READINGS if r.kind is readings.Kind.FLAG)

# contract label -> dcgm-exporter's label
NODE_LABEL = "Hostname"
UUID_LABEL = "UUID"
MODEL_LABEL = "modelName"
INDEX_LABEL = "gpu"
JOB_LABEL = "hpc_job"
# With Kubernetes pod mapping on and no hpc_job, the job is the pod's, by its name (gpufleet.podnames).
NAMESPACE_LABEL = "namespace"
POD_LABEL = "pod"
# The workload's pod, with Kubernetes pod mapping on. Scraped by a Prometheus Operator ServiceMonitor
# without honor_labels, the target's own pod and namespace (the exporter's) take these names and the
# workload's become exported_pod and exported_namespace.
POD_LABELS = (("exported_pod", "exported_namespace"), ("pod", "namespace"))
# A DaemonSet's pods are named after it: a pod of this name is the exporter itself, never a workload.
_EXPORTER_POD = "dcgm-exporter"
# Where the pod's own labels may sit on a series: under their Prometheus form (dcgm-exporter's
# --kubernetes-enable-pod-labels), or with kube-state-metrics' label_ prefix (copied from kube_pod_labels
# at scrape or by relabelling).
_POD_LABEL_FORMS = tuple(
    (label, (pod_jobs.prometheus_label(label), "label_" + pod_jobs.prometheus_label(label)))
    for label in pod_jobs.LABELS_READ
)

# reading -> ((alert kind, what it cannot do without the reading), ...), for a source where no GPU has it:
# each detector declares what its kinds need (KindSpec.without), so this follows the detectors the server runs.
MISSING_EFFECTS: Mapping[str, tuple[tuple[str, str], ...]] = registry.missing_effects(registry.STANDARD)


def job_of(labels: Mapping[str, Any], owners: bool = True) -> str | None:
    """The job a dcgm-exporter series' GPU runs, from its labels, most certain first: `hpc_job` (HPC job
    mapping: Slurm and others), then the workload pod's owner as its job-name labels say (JobSet, Kubeflow
    PyTorchJob/MPIJob/TFJob, MPI operator, LeaderWorkerSet, Volcano, Job), then the pod's name less its
    controllers' suffixes (llama-worker-3 -> llama). NAMESPACE/NAME for a pod's; None without either.

    `owners` False: `pod` and `namespace` by the pod's name alone, as a shard's read of the database
    selects a pod's series (ingest/prometheus.py): a job named otherwise could hash to a shard that
    never reads it."""
    job = labels.get(JOB_LABEL)
    if isinstance(job, str) and job:
        return job
    if not owners:
        pod, namespace = labels.get(POD_LABEL), labels.get(NAMESPACE_LABEL)
        if isinstance(pod, str) and pod and isinstance(namespace, str) and namespace:
            return pod_jobs.job_from_pod_name(namespace, pod)
        return None
    for pod_label, namespace_label in POD_LABELS:
        pod, namespace = labels.get(pod_label), labels.get(namespace_label)
        if isinstance(pod, str) and pod:
            break
    else:
        return None
    if _EXPORTER_POD in pod:
        return None
    namespace = namespace if isinstance(namespace, str) else ""
    own: dict[str, str] = {}
    for label, forms in _POD_LABEL_FORMS:
        value = next((v for v in map(labels.get, forms) if isinstance(v, str) and v), None)
        if value is not None:
            own[label] = value
    return pod_jobs.job_from_labels(namespace, own) or pod_jobs.job_from_pod_name(namespace, pod)


def metrics_for(field: str) -> tuple[str, ...]:
    """The dcgm-exporter metrics that give a contract field."""
    return tuple(name for name, reading in READINGS.items() if reading.field == field)


def missing_effects(seen_fields: frozenset[str]) -> tuple[tuple[str, str, str], ...]:
    """(reading, detector, effect) for every reading in MISSING_EFFECTS that no GPU has."""
    return tuple(
        (reading, detector, effect)
        for reading, effects in MISSING_EFFECTS.items()
        if reading not in seen_fields
        for detector, effect in effects
    )
