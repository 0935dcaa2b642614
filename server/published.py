"""What a shard of `--shard.jobless fleet` says of the GPUs it reads only as guests: nothing.

Such a shard reads every GPU of no job in the fleet, so its engine infers jobs among them as one unsharded
server does (ingest/owned.py, Ownership). Its engine then holds alerts about the guests too, which other
shards own: every shard would raise them. Here they are left out of what the shard publishes (transitions,
so the store, Alertmanager and /metrics; the alerts, nodes, counts and fleet cells the API and the status
page read),
while the engine itself stays a pure function of its samples.

An alert is the shard's when, at the time it is first seen, it names one of the shard's jobs, a GPU the shard
reads as its own (not a guest), or a node where the shard reads any GPU of its own. The answer is kept for the
alert's life: a node whose GPUs change hands meanwhile (a job starts beside them) does not move an open alert,
which every shard's engine holds alike, so exactly one shard publishes it from start to end.
"""

from __future__ import annotations

import bisect
from dataclasses import replace
from typing import Any, Callable, Iterable, Mapping, Sequence

from gpufleet.server.alerts import Alert, AlertState, Transition
from gpufleet.server.history import Charts, FleetCell
from gpufleet.server.ingest.owned import NodePart
from gpufleet.server.shard import Shard


def publishes(alert: Alert, shard: Shard, part: NodePart | None) -> bool:
    """Whether `shard` publishes `alert`, its node's part as the shard read it when the alert opened (None:
    the shard never read the node, which its name then decides)."""
    if alert.hpc_job:
        return shard.owns_job(alert.hpc_job)
    if alert.node is None:
        return shard.owns_node("")  # about no job and no node: one shard, the same one everywhere
    if part is None:
        return shard.owns_node(alert.node)
    # A GPU missing from the node's sample (gone off the bus) is the shard's where the node has a GPU of its own.
    return part.own and (alert.gpu is None or alert.gpu not in part.guests)


class Publication:
    """publishes(), decided once per alert (by id) from the node parts at hand when it is first seen."""

    def __init__(self, shard: Shard, parts: Callable[[], Mapping[str, NodePart]]) -> None:
        self.shard = shard
        self.parts = parts  # each node's latest NodePart, as the source read it
        self._decided: dict[str, bool] = {}

    def decide(self, alert: Alert) -> bool:
        known = self._decided.get(alert.id)
        if known is None:
            known = self._decided[alert.id] = publishes(alert, self.shard, self.parts().get(alert.node or ""))
        return known

    def adopt(self, alerts: Iterable[Alert]) -> None:
        """Alerts this shard published before (restored from its store) stay its own."""
        for alert in alerts:
            self._decided[alert.id] = True

    def retain(self, ids: Iterable[str]) -> None:
        """Forget the decisions about alerts no longer open."""
        keep = set(ids)
        self._decided = {i: v for i, v in self._decided.items() if i in keep}


class PublishedEngine:
    """The engine as a `--shard.jobless fleet` shard shows it: its transitions, alerts, nodes and counts
    without what is about guests (Publication). Anything else is the engine's own."""

    def __init__(self, engine: Any, publication: Publication) -> None:
        self.inner = engine
        self.publication = publication
        self.guest_gpus = 0  # at the latest advance, for /metrics (an int: read from other threads whole)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def ingest(self, sample: Any) -> None:
        self.inner.ingest(sample)

    def restore(self, alerts: Iterable[Alert]) -> int:
        alerts = list(alerts)
        self.publication.adopt(alerts)
        return int(self.inner.restore(alerts))

    def advance(self, now: float) -> list[Transition]:
        out = self._published(self.inner.advance(now))
        self.publication.retain(a.id for a in self.inner.alerts())
        self.guest_gpus = sum(len(p.guests) for p in self.publication.parts().values())
        return out

    def forget_node(self, node: str, t: float, reason: str) -> list[Transition]:
        return self._published(self.inner.forget_node(node, t, reason))

    def _published(self, transitions: Sequence[Transition]) -> list[Transition]:
        return [t for t in transitions if self.publication.decide(t.alert)]

    def alerts(self) -> list[Alert]:
        return [a for a in self.inner.alerts() if self.publication.decide(a)]

    def nodes(self) -> list[Any]:
        """The nodes with a GPU of the shard's own, less their guests and the alerts it does not publish."""
        parts = self.publication.parts()
        shown = self.alerts()
        out = []
        for node in self.inner.nodes():
            part = parts.get(node.node)
            if part is not None and not part.own:
                continue
            guests = len(part.guests) if part is not None else 0
            out.append(replace(node, gpus=node.gpus - guests, open_alerts=sum(1 for a in shown if a.node == node.node)))
        return out

    def guest_nodes(self) -> list[Any]:
        """The nodes read for their guests alone, left out of nodes(): the runtime forgets those gone silent
        past its grace as it forgets its own, so that a guest node that left the fleet does not stay here."""
        parts = self.publication.parts()
        return [n for n in self.inner.nodes() if (p := parts.get(n.node)) is not None and not p.own]

    def published_charts(self, charts: Charts) -> Charts:
        """The status page's fleet cells without the guests: a GPU's cell where it is a guest, a node's cell
        (past the page's GPU cells) where the shard reads none of its GPUs as its own."""
        parts = self.publication.parts()

        def shown(cell: FleetCell) -> bool:
            part = parts.get(cell.node)
            if part is None:
                return True
            return part.own if charts.fleet_per_node or cell.gpu is None else cell.gpu not in part.guests

        return replace(charts, fleet=tuple(c for c in charts.fleet if shown(c)))

    def stats(self) -> Any:
        """The engine's counts of GPUs, nodes and alerts as the shard shows them (nodes())."""
        nodes = self.nodes()
        shown = self.alerts()
        return replace(
            self.inner.stats(),
            gpus=sum(n.gpus for n in nodes),
            nodes=len(nodes),
            open_alerts=len(shown),
            firing_alerts=sum(1 for a in shown if a.state is AlertState.FIRING),
            gpus_unjudged=sum(n.unjudged_gpus for n in nodes),
        )


def published_alerts(alerts: Iterable[Alert], shard: Shard, timeline: Mapping[str, Sequence[NodePart]]) -> list[Alert]:
    """A replay's alerts that `shard` publishes, each decided by its node's part as read at the latest sample
    up to when the alert opened (`timeline`: each node's parts in time order, as replay_db records them)."""
    times = {node: [p.time for p in parts] for node, parts in timeline.items()}
    out = []
    for alert in alerts:
        node = alert.node or ""
        parts = timeline.get(node, ())
        at = max(0, bisect.bisect_right(times.get(node, []), alert.pending_since) - 1)
        if publishes(alert, shard, parts[at] if parts else None):
            out.append(alert)
    return out
