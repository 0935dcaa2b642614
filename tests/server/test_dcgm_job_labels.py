"""A dcgm-exporter GPU's job from its series' labels, before any inference: hpc_job, the workload pod's
owner by its job-name label (as dcgm-exporter's pod-label enrichment or a kube_pod_labels copy writes it),
else the pod's name less its controllers' suffixes."""

from __future__ import annotations

import pytest

from gpufleet.server.ingest.dcgm import job_of
from tests.server.test_prometheus_dcgm import dcgm_series
from tests.server.test_prometheus_source import FakePrometheus, make_source, run

POD = {"pod": "llama-worker-3", "namespace": "team-a", "container": "pytorch"}


@pytest.mark.parametrize(
    ("labels", "job"),
    [
        # PyTorchJob (Kubeflow training operator), as dcgm-exporter's --kubernetes-enable-pod-labels writes it
        ({**POD, "training_kubeflow_org_job_name": "llama-70b"}, "team-a/llama-70b"),
        # the same label copied from kube-state-metrics' kube_pod_labels
        ({**POD, "label_training_kubeflow_org_job_name": "llama-70b"}, "team-a/llama-70b"),
        # JobSet: its child Jobs' batch label on the pods too; the JobSet is the job
        (
            {
                "pod": "train-workers-0-1-x7k2p",
                "namespace": "ml",
                "jobset_sigs_k8s_io_jobset_name": "train",
                "batch_kubernetes_io_job_name": "train-workers-0",
            },
            "ml/train",
        ),
        # MPIJob under MPI operator v1
        ({"pod": "bert-worker-2", "namespace": "ml", "mpi_job_name": "bert"}, "ml/bert"),
        # a plain batch Job
        ({"pod": "sweep-4-q9d2w", "namespace": "ml", "batch_kubernetes_io_job_name": "sweep"}, "ml/sweep"),
        # LeaderWorkerSet: one job per group
        (
            {
                "pod": "serve-1-3",
                "namespace": "inf",
                "leaderworkerset_sigs_k8s_io_name": "serve",
                "leaderworkerset_sigs_k8s_io_group_index": "1",
            },
            "inf/serve-1",
        ),
    ],
    ids=["pytorchjob", "kube_pod_labels_copy", "jobset", "mpijob_v1", "batch_job", "leaderworkerset"],
)
def test_a_pods_owner_label_names_its_job(labels, job):
    assert job_of(labels) == job


@pytest.mark.parametrize(
    ("pod", "job"),
    [
        ("llama-worker-3", "team-a/llama"),  # PyTorchJob worker
        ("llama-master-0", "team-a/llama"),  # PyTorchJob master: the same job
        ("train-workers-0-1-x7k2p", "team-a/train-workers"),  # JobSet replicated job, pod of Job index 0
        ("sweep-4-q9d2w", "team-a/sweep"),  # Indexed Job
    ],
)
def test_without_an_owner_label_the_pod_name_less_its_suffixes_names_the_job(pod, job):
    assert job_of({"pod": pod, "namespace": "team-a"}) == job


def test_hpc_job_comes_first():
    assert job_of({**POD, "training_kubeflow_org_job_name": "llama-70b", "hpc_job": "81234"}) == "81234"


def test_the_workload_pod_under_exported_labels_wins_over_the_exporters_own():
    # A ServiceMonitor without honor_labels: pod/namespace are the exporter's, exported_* the workload's.
    labels = {
        "pod": "nvidia-dcgm-exporter-7x2kq",
        "namespace": "gpu-operator",
        "exported_pod": "llama-worker-3",
        "exported_namespace": "team-a",
    }
    assert job_of(labels) == "team-a/llama"


def test_no_pod_or_the_exporters_own_pod_names_no_job():
    assert job_of({"Hostname": "node-a"}) is None
    assert job_of({"pod": "", "namespace": "team-a"}) is None
    assert job_of({"pod": "dcgm-exporter-4kq9z", "namespace": "monitoring"}) is None


def test_a_malformed_owner_label_falls_back_to_the_pod_name():
    assert job_of({**POD, "training_kubeflow_org_job_name": "not a name!"}) == "team-a/llama"


def test_gpus_of_one_pytorchjob_on_two_nodes_read_through_prometheus_are_one_job():
    prom = FakePrometheus()
    prom.stored = (
        dcgm_series("node-a", 0, [990.0], pod="llama-master-0", namespace="team-a")
        + dcgm_series("node-b", 0, [990.0], pod="llama-worker-0", namespace="team-a")
        + dcgm_series("node-b", 1, [990.0])
    )
    src, _ = make_source(prom)
    samples = {s.node: s for s in run(src.pull_once()).samples}
    assert samples["node-a"].jobs == ("team-a/llama",)
    assert samples["node-b"].jobs == ("team-a/llama", None)


def test_on_a_shard_the_pod_name_alone_names_the_job_as_the_shards_read_selects_it():
    labels = {**POD, "training_kubeflow_org_job_name": "llama-70b"}
    assert job_of(labels, owners=False) == "team-a/llama"
    assert job_of({**labels, "hpc_job": "81234"}, owners=False) == "81234"
    assert job_of({"Hostname": "node-a"}, owners=False) is None
