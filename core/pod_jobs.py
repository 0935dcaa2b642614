"""Which Kubernetes job a pod is part of, from its labels or its name: what the agent reads from the API
server and the server reads off dcgm-exporter's series alike."""

from __future__ import annotations

import re
from typing import Mapping

from gpufleet.podnames import job_from_pod_name

__all__ = ["JOB_LABELS", "LABELS_READ", "job_from_labels", "job_from_pod_name", "prometheus_label"]

# A pod's labels that name its job, most specific first: a JobSet's child Jobs put batch.kubernetes.io/job-name
# on its pods too, and the JobSet is the job. (label, what sets it)
JOB_LABELS: tuple[tuple[str, str], ...] = (
    ("jobset.sigs.k8s.io/jobset-name", "JobSet; Kubeflow Trainer's TrainJob runs as one"),
    ("training.kubeflow.org/job-name", "Kubeflow training operator: PyTorchJob, MPIJob v2, TFJob, JAXJob"),
    ("mpi-job-name", "MPI operator v1"),
    ("leaderworkerset.sigs.k8s.io/name", "LeaderWorkerSet: one job per group, NAME-GROUP"),
    ("volcano.sh/job-name", "Volcano Job"),
    ("batch.kubernetes.io/job-name", "Kubernetes Job"),
    ("job-name", "Kubernetes Job, before 1.27"),
)
_LWS_GROUP = "leaderworkerset.sigs.k8s.io/group-index"
# Every label job_from_labels reads.
LABELS_READ: tuple[str, ...] = (*(label for label, _ in JOB_LABELS), _LWS_GROUP)
_NOT_IN_PROMETHEUS_NAME = re.compile(r"[^A-Za-z0-9_]")
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


def job_from_labels(namespace: str, labels: Mapping[str, str]) -> str | None:
    """NAMESPACE/NAME of the job the first of JOB_LABELS names; None when none is set to a valid name."""
    for label, _ in JOB_LABELS:
        name = labels.get(label, "")
        if not _LABEL_VALUE.match(name):
            continue
        if label == "leaderworkerset.sigs.k8s.io/name":
            group = labels.get(_LWS_GROUP, "")
            if not group.isdigit():
                continue
            name = f"{name}-{group}"
        return f"{namespace}/{name}"
    return None


def prometheus_label(label: str) -> str:
    """A Kubernetes label's name as an exporter writes it on a Prometheus series: each character a
    Prometheus label name cannot hold as `_` (training.kubeflow.org/job-name: training_kubeflow_org_job_name)."""
    return _NOT_IN_PROMETHEUS_NAME.sub("_", label)
