"""What an alert carries when it leaves the server for people and routers: the configured external labels
(cluster, site, ...), the Kubernetes namespace and pod of its subject, and a runbook link.

The engine neither knows nor needs any of it: this is routing, not detection, so replay's findings are
the same with or without it. An alert keeps the labels it first left with for its whole life, because
Alertmanager tells alerts apart by their labels: a resolution sent under other labels (the pod ended
meanwhile) would leave the firing alert open until it expires.
"""

from __future__ import annotations

import string
from dataclasses import replace
from typing import Iterable, Mapping

from gpufleet.server.alerts import Alert, AlertState, cause
from gpufleet.server.contract import NodeSample, Pod

# Labels the server sets itself: an external label may not take one of these names.
RESERVED_LABELS = frozenset(
    {
        "alertname",
        "kind",
        "severity",
        "node",
        "gpu",
        "hpc_job",
        "cause",
        "source",
        "namespace",
        "pod",
        "alert_id",
        "incident",
        "role",
    }
)
RUNBOOK_FIELDS = frozenset({"kind", "alertname", "cause", "id", "node", "gpu", "hpc_job"})


def check_runbook_template(template: str) -> str:
    """The template itself, or ValueError naming a placeholder that is not one of RUNBOOK_FIELDS."""
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as exc:
        raise ValueError(f"not a template: {exc}") from None
    unknown = sorted(names - RUNBOOK_FIELDS)
    if unknown:
        raise ValueError(f"unknown placeholder {{{unknown[0]}}} (use {', '.join(sorted(RUNBOOK_FIELDS))})")
    return template


def alertname(alert: Alert) -> str:
    """The `alertname` label: Gpufleet + the kind in CamelCase, e.g. GpufleetThermalThrottle."""
    return "Gpufleet" + "".join(part.capitalize() for part in alert.kind.value.split("_"))


class AlertRouting:
    """Learns which pod each GPU serves from the ingested samples, and labels alerts on their way out."""

    def __init__(self, external_labels: Mapping[str, str] | None = None, runbook_url: str | None = None) -> None:
        self.external_labels = dict(external_labels or {})
        clash = sorted(set(self.external_labels) & RESERVED_LABELS)
        if clash:
            raise ValueError(f"external label {clash[0]!r} is one the server sets itself")
        self.runbook_url = check_runbook_template(runbook_url) if runbook_url else None
        self._gpus: dict[tuple[str, int], tuple[str | None, Pod]] = {}  # (node, gpu) -> (job, pod)
        self._nodes: set[str] = set()  # nodes whose latest sample named a pod
        self._given: dict[str, Mapping[str, str]] = {}  # alert id -> its labels

    def observe(self, samples: Iterable[NodeSample]) -> None:
        """Remember the newest pod of every GPU (and forget it once the GPU runs none)."""
        for s in samples:
            if not isinstance(s, NodeSample):
                continue
            if s.pods is None and s.node not in self._nodes:
                continue  # no pod on this node before or now: nothing to learn (most samples off Kubernetes)
            if s.pods is None:
                self._nodes.discard(s.node)
            else:
                self._nodes.add(s.node)
            pods = s.pods or (None,) * len(s.indices)
            for index, job, pod in zip(s.indices, s.jobs, pods):
                if pod is None:
                    self._gpus.pop((s.node, index), None)
                else:
                    self._gpus[(s.node, index)] = (job, pod)

    def label(self, alert: Alert) -> Alert:
        """The alert with its routing labels and runbook link; the same labels every time for one alert."""
        labels = self._given.get(alert.id)
        if labels is None:
            labels = dict(alert.labels) if alert.labels else {**self.external_labels, **self._pod_labels(alert)}
            if alert.state is not AlertState.RESOLVED:
                self._given[alert.id] = labels
        elif alert.state is AlertState.RESOLVED:
            del self._given[alert.id]
        runbook = self.runbook(alert)
        if labels == alert.labels and runbook == alert.runbook_url:
            return alert
        return replace(alert, labels=labels, runbook_url=runbook)

    def retain(self, open_ids: Iterable[str]) -> None:
        """Forget the labels of alerts that are no longer open (a pending one that cleared)."""
        keep = set(open_ids)
        for alert_id in [a for a in self._given if a not in keep]:
            del self._given[alert_id]

    def _pod_labels(self, alert: Alert) -> dict[str, str]:
        """namespace (and pod) of the alert's subject, where all its GPUs agree on them."""
        if alert.node is not None and alert.gpu is not None:
            found = self._gpus.get((alert.node, alert.gpu))
            pods = {found[1]} if found else set()
        else:
            pods = {
                pod
                for (node, _), (job, pod) in self._gpus.items()
                if (alert.node is None or node == alert.node) and (alert.hpc_job is None or job == alert.hpc_job)
            }
            if alert.node is None and alert.hpc_job is None:
                pods = set()
        namespaces = {ns for ns, _ in pods}
        if len(namespaces) != 1:
            return {}
        (namespace,) = namespaces
        return {"namespace": namespace, "pod": next(iter(pods))[1]} if len(pods) == 1 else {"namespace": namespace}

    def runbook(self, alert: Alert) -> str | None:
        """The alert's runbook link from the configured template; None without one."""
        if self.runbook_url is None:
            return None
        return self.runbook_url.format(
            kind=alert.kind.value,
            alertname=alertname(alert),
            cause=cause(alert),
            id=alert.id,
            node=alert.node or "",
            hpc_job=alert.hpc_job or "",
            gpu="" if alert.gpu is None else alert.gpu,
        )
