"""The job a Kubernetes pod belongs to, from its name alone: what the agent falls back on where no operator
label names the job, and what the server reads from dcgm-exporter's `namespace`/`pod` labels, so that both name
one job alike (and a sharded server hashes the same id)."""

from __future__ import annotations

import re

# The suffixes controllers put after a job's name: a Job's pod's five random characters (the alphabet
# Kubernetes' name generator draws from), indexes (StatefulSet, Indexed Job, operators' replicas) and the
# training operators' replica types.
_RANDOM_SUFFIX = re.compile(r"-[bcdfghjklmnpqrstvwxz2456789]{5}$")
_INDEX_SUFFIX = re.compile(r"-[0-9]+$")
_ROLE_SUFFIX = re.compile(r"-(master|worker|launcher|chief|ps|evaluator|leader|driver)$")


def job_from_pod_name(namespace: str, pod: str) -> str:
    """NAMESPACE/NAME, the pod's name less its controllers' suffixes: llama-worker-3 and llama-master-0
    (PyTorchJob) -> llama, train-2-x7k2p (Indexed Job) -> train, ckpt-0 (StatefulSet) -> ckpt."""
    name = _RANDOM_SUFFIX.sub("", pod)
    while True:
        stripped = _ROLE_SUFFIX.sub("", _INDEX_SUFFIX.sub("", name))
        if stripped == name or not stripped:
            break
        name = stripped
    return f"{namespace}/{name}"
