"""A pod's job: from each owner's label, else from the pod's name less its controllers' suffixes. The labels
read from a real API server are tested with the kubelet in test_podresources.py."""

from __future__ import annotations

import pytest

from gpufleet.agent.pod_jobs import job_from_labels, job_from_pod_name


@pytest.mark.parametrize(
    ("labels", "job"),
    [
        ({"training.kubeflow.org/job-name": "llama", "training.kubeflow.org/replica-type": "worker"}, "ns/llama"),
        ({"jobset.sigs.k8s.io/jobset-name": "sweep", "batch.kubernetes.io/job-name": "sweep-w-0"}, "ns/sweep"),
        ({"mpi-job-name": "allreduce", "mpi-job-role": "worker"}, "ns/allreduce"),
        ({"leaderworkerset.sigs.k8s.io/name": "vllm", "leaderworkerset.sigs.k8s.io/group-index": "2"}, "ns/vllm-2"),
        ({"volcano.sh/job-name": "bert"}, "ns/bert"),
        ({"batch.kubernetes.io/job-name": "train", "job-name": "train"}, "ns/train"),
        ({"job-name": "old-train"}, "ns/old-train"),
        ({"app": "coredns"}, None),
        ({"training.kubeflow.org/job-name": "bad name!"}, None),
        ({"leaderworkerset.sigs.k8s.io/name": "vllm"}, None),  # a group without its index is no job
    ],
)
def test_the_job_from_each_owners_label(labels, job):
    assert job_from_labels("ns", labels) == job


@pytest.mark.parametrize(
    ("pod", "job"),
    [
        ("llama-worker-3", "ns/llama"),  # PyTorchJob
        ("llama-master-0", "ns/llama"),
        ("allreduce-launcher-x7k2p", "ns/allreduce"),  # MPIJob v2's launcher Job
        ("train-2-x7k2p", "ns/train"),  # Indexed Job
        ("train-x7k2p", "ns/train"),  # Job
        ("ckpt-0", "ns/ckpt"),  # StatefulSet
        ("vllm-1-3", "ns/vllm"),  # LeaderWorkerSet worker
        ("bare", "ns/bare"),
    ],
)
def test_without_labels_the_job_is_the_pods_name_less_its_controllers_suffixes(pod, job):
    assert job_from_pod_name("ns", pod) == job
