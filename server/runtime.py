"""The live pipeline, one cycle per pull interval: source -> engine -> store -> notifiers, and a view.

The engine runs in a worker thread, one cycle at a time, and only this module touches it; request
handlers read the immutable FleetView published after each cycle and the store, never the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import sqlite3
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

from gpufleet.server.alerts import Alert, AlertKind, AlertState, Transition
from gpufleet.server.history import ChartHistory, Charts
from gpufleet.server.ingest.agent_alerts import AgentAlerts, is_ours
from gpufleet.server.ingest.base import SampleSource, TargetHealth
from gpufleet.server.incidents import IncidentTracker
from gpufleet.server.ingest.identity import NodePin
from gpufleet.server.notify import Notifier
from gpufleet.server.routing import AlertRouting
from gpufleet.server.shard import Shard
from gpufleet.server.store import AlertStore

log = logging.getLogger(__name__)

DEFAULT_REMOVED_GRACE_SECONDS = 300.0
REMOVED_REASON = "target removed from discovery"
HANDED_OVER_REASON = "its jobs belong to another shard"


@dataclass(frozen=True, slots=True)
class FleetView:
    """What the engine reported after the latest cycle, as plain values."""

    alerts: tuple[Alert, ...] = ()
    jobs: tuple[dict[str, Any], ...] = ()
    nodes: tuple[dict[str, Any], ...] = ()
    stats: dict[str, Any] = field(default_factory=dict)
    evaluated_at: float | None = None
    charts: Charts = field(default_factory=Charts)  # what the pages draw (server/history.py)


@dataclass(slots=True)
class CycleStats:
    """Counters about the pipeline itself, for /metrics and /healthz."""

    cycles_total: int = 0
    cycle_failures_total: int = 0
    tick_duration_seconds: float | None = None
    last_tick: float | None = None
    transitions_total: int = 0
    store_errors_total: int = 0
    overruns_total: int = 0
    store_unsaved_changes: int = 0  # alert states, node names and pins waiting for a store write
    store_unsaved_since: float | None = None  # when the oldest of them first failed to be written


class Runtime:
    """Owns the engine and drives it from the sample source on a fixed interval."""

    def __init__(
        self,
        *,
        engine: Any,
        source: SampleSource,
        store: AlertStore,
        notifiers: Sequence[Notifier] = (),
        pull_interval_seconds: float = 5.0,
        clock: Callable[[], float] = time.time,
        prune_interval_seconds: float = 3600.0,
        agent_alerts: AgentAlerts | None = None,
        routing: AlertRouting | None = None,
        removed_grace_seconds: float = DEFAULT_REMOVED_GRACE_SECONDS,
        shard: Shard | None = None,
    ) -> None:
        self.engine = engine
        self.shard = shard or Shard()  # the part of the fleet this engine judges, which the API names
        self.routing = routing or AlertRouting()
        self.incidents = IncidentTracker()
        self.source = source
        # Agents the engine has no samples from (down or silent since we started) alert from here.
        self.agent_alerts = agent_alerts or AgentAlerts(after_seconds=source.stale_after_seconds)
        self.store = store
        self.notifiers = tuple(notifiers)
        self.pull_interval_seconds = pull_interval_seconds
        self.prune_interval_seconds = prune_interval_seconds
        self.removed_grace_seconds = removed_grace_seconds
        self._unwatched: dict[str, float] = {}  # node -> since when no target is its and it sent nothing
        self.clock = clock
        self.view = FleetView()
        self.charts = ChartHistory()
        self.stats = CycleStats()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._last_prune: float | None = None
        self._cycled = threading.Condition()
        # What the store has not taken yet (a full disk): each alert's latest state by id, node names and pins.
        # Written again every cycle until it is; the newest state of an alert replaces an older one.
        self._unsaved: dict[str, Alert] = {}
        self._unsaved_nodes: dict[str, str] = {}
        self._unsaved_pins: dict[str, NodePin | None] = {}
        self._unjudged_warned = 0  # unjudged busy GPUs at the last warning (or since it fell)
        # One dedicated thread: the engine is not thread-safe, and a single thread keeps its large
        # allocations in one malloc arena instead of spreading them over the default pool's threads.
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpufleet-engine")

    def wait_for_cycles(self, count: int, timeout: float) -> bool:
        """Block until `count` cycles have completed (for callers on other threads); False on timeout."""
        with self._cycled:
            return self._cycled.wait_for(lambda: self.stats.cycles_total >= count, timeout)

    def restore(self) -> int:
        """Hand the store's open alerts back to the engine after a restart; returns how many."""
        try:
            alerts = [self.routing.label(a) for a in self.store.open_alerts()]
            nodes = self.store.target_nodes()
            pins = self.store.node_pins()
        except sqlite3.Error as exc:
            # Damage the start check did not see: the engine re-raises from the agents what is still wrong, and
            # /healthz says the store fails; dying here would leave the fleet unwatched.
            log.error("alert store unreadable: starting without its open alerts", extra={"error": str(exc)})
            alerts, nodes, pins = [], {}, {}
        alerts = self._keep_owned(alerts)
        self.agent_alerts.restore(alerts, nodes)
        self.incidents.restore(alerts)
        self.source.remember_identities(nodes, pins)
        if alerts:
            self.engine.restore([a for a in alerts if not is_ours(a)])
            log.info("open alerts restored", extra={"alerts": len(alerts)})
        # Notifiers start empty: tell them what is already firing (as refreshes, so nothing is re-announced)
        # and Alertmanager keeps receiving it until it resolves.
        still_firing = [Transition(a, AlertState.FIRING) for a in alerts if a.state is AlertState.FIRING]
        for notifier in self.notifiers:
            notifier.submit(still_firing)
        self.view = self._snapshot_view(None)
        return len(alerts)

    def _keep_owned(self, alerts: list[Alert]) -> list[Alert]:
        """The open alerts of the jobs and nodes this shard owns; the others (COUNT or INDEX changed since
        they were stored) are resolved in the store, as their new shard raises them from its own history."""
        foreign = [a for a in alerts if not self.shard.owns(a.hpc_job, a.node or "")]
        if not foreign:
            return alerts
        now = self.clock()
        resolved = [
            replace(
                a,
                state=AlertState.RESOLVED,
                resolved=max(now, a.updated),
                updated=max(now, a.updated),
                evidence={**a.evidence, "resolved_reason": HANDED_OVER_REASON},
            )
            for a in foreign
        ]
        try:
            self.store.upsert(resolved)
        except sqlite3.Error as exc:
            log.error("alert store unwritable: another shard's alerts stay open in it", extra={"error": str(exc)})
        log.info(
            "open alerts of another shard's part resolved", extra={"alerts": len(foreign), "shard": str(self.shard)}
        )
        gone = {a.id for a in foreign}
        return [a for a in alerts if a.id not in gone]

    async def start(self) -> None:
        """Restore state and launch the pull loop and the notifiers' delivery tasks."""
        await asyncio.get_running_loop().run_in_executor(self._executor, self.restore)
        self._stop.clear()
        self._tasks = [asyncio.create_task(self._loop(), name="gpufleet-pipeline")]
        self._tasks += [
            asyncio.create_task(n.run(self._stop), name=f"gpufleet-notify-{n.name}") for n in self.notifiers
        ]

    async def stop(self) -> None:
        """Stop the loop and notifiers, then close connections and the database."""
        self._stop.set()
        for task in self._tasks:
            try:
                await asyncio.wait_for(task, timeout=10)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                task.cancel()
        self._tasks = []
        self._executor.shutdown(wait=True)
        if self._unsaved_changes():
            self._persist([], self.clock(), {}, {})  # one last try before the database closes
        await self.source.aclose()
        for notifier in self.notifiers:
            await notifier.aclose()
        self.store.close()

    async def cycle(self) -> list[Transition]:
        """One pull, engine step, store write and notification; returns the engine's transitions."""
        result = await self.source.pull_once()
        now = self.clock()
        loop = asyncio.get_running_loop()
        transitions = await loop.run_in_executor(
            self._executor, self._step, result.samples, now, result.pins, result.handed_over
        )
        for notifier in self.notifiers:
            notifier.submit(transitions)
        return transitions

    def _step(
        self,
        samples: list[Any],
        now: float,
        pins: Mapping[str, NodePin | None],
        handed_over: Sequence[str] = (),
    ) -> list[Transition]:
        """Engine ingest + advance, then persistence; runs on the engine thread."""
        t0 = time.perf_counter()
        self.routing.observe(samples)
        for sample in samples:
            self.engine.ingest(sample)
        # A node whose GPUs now all run another shard's jobs is that shard's to judge: resolved and freed
        # here (after its older samples of this cycle), else it would read as unreachable once they stop.
        transitions = [t for node in handed_over for t in self.engine.forget_node(node, now, HANDED_OVER_REASON)]
        transitions += self.engine.advance(now)
        view = self._snapshot_view(now)
        health = self.source.health()
        named = self.agent_alerts.learn(health)
        departed = self._forget_departed(health, view, now)
        if departed:
            transitions += departed
            view = self._snapshot_view(now)
        agent_transitions = self.agent_alerts.step(health, _watched_nodes(view), now)
        if agent_transitions:
            transitions += agent_transitions
            engine_alerts = tuple(a for a in view.alerts if not is_ours(a))
            view = replace(view, alerts=engine_alerts + tuple(self.agent_alerts.alerts()))
        # Labelled on the way out, in the order the engine made them: an alert's first labels are the ones it keeps.
        transitions = [Transition(self.routing.label(t.alert), t.previous) for t in transitions]
        view = replace(view, alerts=tuple(self.routing.label(a) for a in view.alerts))
        self.routing.retain(a.id for a in view.alerts)
        grouped, transitions = self.incidents.step(view.alerts, transitions)
        view = replace(view, alerts=grouped)
        view = replace(view, charts=self._charts(view))
        self._unjudged_warned = warn_unjudged(view, self._unjudged_warned)
        self.stats.tick_duration_seconds = time.perf_counter() - t0
        self.stats.last_tick = now
        self.stats.cycles_total += 1
        self.stats.transitions_total += len(transitions)
        self.view = view
        self._persist(transitions, now, named, pins)
        with self._cycled:
            self._cycled.notify_all()
        for t in transitions:
            if t.previous != t.alert.state:
                a = t.alert
                log.info(
                    "alert " + a.state.value,
                    extra={
                        "alert_id": a.id,
                        "kind": a.kind.value,
                        "severity": a.severity.value,
                        "node": a.node,
                        "gpu": a.gpu,
                        "hpc_job": a.hpc_job,
                    },
                )
        return transitions

    def _charts(self, view: FleetView) -> Charts:
        """The pages' pictures for this cycle; a failure to draw them must not stop detection."""
        try:
            charts = self.charts.observe(self.engine, view.alerts)
            shown = getattr(self.engine, "published_charts", None)  # a shard's guests left out (server/published.py)
            return shown(charts) if shown is not None else charts
        except Exception:  # noqa: BLE001 - the pictures are an aid, the alerts are the product
            log.exception("chart history not updated this cycle")
            return self.view.charts

    def _forget_departed(self, health: Sequence[TargetHealth], view: FleetView, now: float) -> list[Transition]:
        """Resolve the alerts of nodes that left discovery and free the engine's state of them.

        A node has left when no current target is its (by the name it reported, or the one remembered
        for it) and no sample of it arrived, for removed_grace_seconds: a pod rescheduled under a new
        address, or a target file edited back, comes back within it. After a restart with fewer targets,
        the alerts restored for the nodes no longer there resolve the same way, instead of firing forever."""
        claimed = {h.node or self.agent_alerts.nodes.get(h.target) for h in health}
        nodes: dict[str, float | None] = {n["node"]: n.get("last_sample_time") for n in view.nodes if n.get("node")}
        # A shard's guest nodes (--shard.jobless fleet, server/published.py) are no target's here: only their
        # samples keep them.
        nodes.update((n.node, n.last_sample_time) for n in getattr(self.engine, "guest_nodes", list)())
        for a in view.alerts:
            if a.node is not None and not is_ours(a):
                nodes.setdefault(a.node, None)
        heard = {node for node, last in nodes.items() if last is not None and now - last <= self.removed_grace_seconds}
        unwatched = set(nodes) - claimed - heard
        self._unwatched = {node: self._unwatched.get(node, now) for node in unwatched}
        out: list[Transition] = []
        for node, since in list(self._unwatched.items()):
            if now - since >= self.removed_grace_seconds:
                resolved = self.engine.forget_node(node, now, REMOVED_REASON)
                del self._unwatched[node]
                log.info(
                    "node left discovery; its alerts resolved and its state freed",
                    extra={"node": node, "alerts": len(resolved), "grace_seconds": self.removed_grace_seconds},
                )
                out += resolved
        return out

    def _snapshot_view(self, now: float | None) -> FleetView:
        """Copy what handlers may read out of the engine."""
        return FleetView(
            alerts=tuple(self.engine.alerts()) + tuple(self.agent_alerts.alerts()),
            jobs=tuple(j.to_dict() for j in self.engine.jobs()),
            nodes=tuple(n.to_dict() for n in self.engine.nodes()),
            stats=dict(self.engine.stats().to_dict()),
            evaluated_at=now,
        )

    def _persist(
        self, transitions: list[Transition], now: float, named: dict[str, str], pins: Mapping[str, NodePin | None]
    ) -> None:
        """Upsert changed alerts, node names and pins, prune history now and then. A failed write is kept and
        retried every cycle until the store takes it (a full disk must neither stop detection nor lose an
        alert); meanwhile /metrics and /healthz show how much waits and since when."""
        for t in transitions:
            self._unsaved[t.alert.id] = t.alert
        self._unsaved_nodes.update(named)
        self._unsaved_pins.update(pins)
        try:
            if self._unsaved:
                self.store.upsert(self._unsaved.values())
                self._unsaved = {}
            if self._unsaved_nodes:
                self.store.remember_target_nodes(self._unsaved_nodes)
                self._unsaved_nodes = {}
            if self._unsaved_pins:
                self.store.remember_node_pins(self._unsaved_pins)
                self._unsaved_pins = {}
            if self.stats.store_unsaved_since is not None:
                log.info(
                    "alert store writable again; unsaved changes written",
                    extra={"unsaved_seconds": round(now - self.stats.store_unsaved_since, 3)},
                )
            self.stats.store_unsaved_since = None
            if self._last_prune is None or now - self._last_prune >= self.prune_interval_seconds:
                self._last_prune = now
                self.store.prune(now)
        except Exception as exc:  # noqa: BLE001 - a full disk must not stop detection
            self.stats.store_errors_total += 1
            if self.stats.store_unsaved_since is None and self._unsaved_changes():
                self.stats.store_unsaved_since = now
            # The 1st, 2nd, 4th, 8th... failure is logged: a disk full for hours must not fill the log too.
            n = self.stats.store_errors_total
            if not n & (n - 1):
                log.error(
                    "alert store write failed; retrying every cycle",
                    extra={
                        "error": str(exc) or exc.__class__.__name__,
                        "failures": n,
                        "unsaved_changes": self._unsaved_changes(),
                    },
                )
        self.stats.store_unsaved_changes = self._unsaved_changes()

    def _unsaved_changes(self) -> int:
        """How many alert states, node names and pins wait for a store write."""
        return len(self._unsaved) + len(self._unsaved_nodes) + len(self._unsaved_pins)

    async def _loop(self) -> None:
        """Run cycles every pull interval until stopped; a failing cycle is logged and retried next time."""
        interval = self.pull_interval_seconds
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                await self.cycle()
            except Exception:  # noqa: BLE001 - the loop must outlive any single bad cycle
                self.stats.cycle_failures_total += 1
                log.exception("pipeline cycle failed")
            next_at += interval
            delay = next_at - time.monotonic()
            if delay < 0:
                self.stats.overruns_total += 1
                log.warning("pull cycle overran the interval", extra={"behind_seconds": round(-delay, 3)})
                next_at = time.monotonic()
                delay = 0
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=delay)
            except asyncio.TimeoutError:
                pass


def warn_unjudged(view: FleetView, warned: int) -> int:
    """Log a warning when more busy GPUs are unjudged than at the last warning (a GPU no straggler
    comparison can name is a blind spot the operator should know of); returns the count to compare the
    next evaluation with: this one's, so a fall re-arms the warning."""
    count = int(view.stats.get("gpus_unjudged") or 0)
    if count > warned:
        per_node = {n["node"]: n["unjudged_gpus"] for n in view.nodes if n.get("unjudged_gpus")}
        log.warning(
            "busy GPUs without peers to judge them by: no straggler can be named among them",
            extra={"gpus_unjudged": count, "was": warned, "nodes": per_node},
        )
    return count


def _watched_nodes(view: FleetView) -> set[str]:
    """Nodes the engine speaks for: the ones it tracks, and any it holds a node_unreachable alert about."""
    nodes = {n["node"] for n in view.nodes if n.get("node")}
    nodes.update(a.node for a in view.alerts if a.kind == AlertKind.NODE_UNREACHABLE and a.node and not is_ours(a))
    return nodes
