"""The detection engine: a pure function of the samples fed to it and the `now` passed to advance().

Flow per closed tick bin: windows -> smoothed per-GPU readings -> peer groups and their baselines ->
detectors (registry.STANDARD, or the tuple given, in order) -> lifecycle -> transitions. No wall clock, no
randomness, no I/O: the live server and offline replay produce identical alerts from identical samples.
"""

from __future__ import annotations

import math
from typing import AbstractSet, Any, Iterable, Sequence

import numpy as np

from gpufleet.server.alerts import Alert, AlertKind, AlertState, Transition
from gpufleet.server.contract import NodeSample
from gpufleet.server.engine.arrays import grown
from gpufleet.server.engine.config import EngineConfig
from gpufleet.server.engine import registry as detectors_registry
from gpufleet.server.engine.detectors import Context, Outcome, workload
from gpufleet.server.engine.detectors.spec import Detector, joined
from gpufleet.server.engine.groups import JOB, GroupHistory, GroupMembers, GroupRegistry, group_stats
from gpufleet.server.engine.inference import JobInference
from gpufleet.server.engine.lifecycle import Lifecycle
from gpufleet.server.engine.prepared import prepare_windows
from gpufleet.server.engine import severity
from gpufleet.server.engine.tick import SlowdownSource, Tick, read_windows, smoothed
from gpufleet.server.engine.units import VIEW_DIGITS
from gpufleet.server.engine.views import EngineStats, JobHealth, NodeHealth
from gpufleet.server.engine.windows import CounterEvent, Windows

__all__ = ["Engine", "EngineConfig", "EngineStats", "JobHealth", "NodeHealth"]


class Engine:
    """Feed samples with ingest(), evaluate with advance(now), read alerts() / jobs() / nodes().

    `detectors` are run in their order at every tick (registry.STANDARD unless given)."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        detectors: Iterable[Detector[Any]] = detectors_registry.STANDARD,
    ) -> None:
        cfg = self.config = config or EngineConfig()
        cfg.validate()
        self.detectors = tuple(detectors)
        detectors_registry.check(self.detectors, cfg)
        self.windows = Windows(cfg.tick_seconds, cfg.bins(cfg.window_seconds))
        self.registry = GroupRegistry(cfg.group_retention_seconds)
        self._inference = JobInference(cfg)
        self._troubled: np.ndarray | None = None  # per slot, see _inferred_in_trouble
        self._last_group = np.full(0, -1, dtype=np.int64)  # per slot, the last group it was in (GPU-level)
        # Noise is read from changes over twice the smoothing: readings that far apart share no sample.
        self.history = GroupHistory(
            cfg.bins(cfg.baseline_seconds),
            cfg.baseline_percentile,
            cfg.bins(cfg.min_history_seconds),
            cfg.bins(cfg.noise_lag_smooth_factor * cfg.smooth_seconds),
        )
        self.lifecycle = Lifecycle(
            detectors_registry.durations(self.detectors, cfg),
            cfg.pending_grace_seconds,
            detectors_registry.advice(self.detectors),
            # A rolling median crosses a threshold once half its window does (see registry.onset_lead).
            onset_lead=detectors_registry.onset_leads(self.detectors, cfg),
            early_run=detectors_registry.early_runs(self.detectors, cfg),
        )
        self._costing = detectors_registry.costing(self.detectors)
        self._states = tuple(detector.state() for detector in self.detectors)
        self._next_bin: int | None = None
        self._first: float | None = None  # time of the oldest sample of the first flush that binned any
        self._ticks = 0
        self._last_t: float | None = None
        self._last_tick: Tick | None = None
        self._job_ticks: dict[str, list[int]] = {}
        self._job_lost: dict[str, dict[AlertKind, float]] = {}
        self._regime_ticks = np.zeros(0, dtype=np.int64)
        self._last_busy_t = np.full(0, -np.inf)
        self._members: GroupMembers | None = None
        self._dated = 0  # groups [0, _dated) have been checked by _date_running
        self._unjudged = np.zeros(0, dtype=bool)  # per slot, at the last tick: see unjudged()

    # -- input ------------------------------------------------------------------------------
    def ingest(self, sample: NodeSample) -> None:
        """Queue one validated snapshot (any order; late and duplicate samples tolerated)."""
        self.windows.add(sample)

    def prepare(self, samples: list[NodeSample]) -> None:
        """Replay: exactly these samples, sorted by time then node, will be ingested in this order (see
        prepared.prepare_windows). The alerts are the same as without this call; the flushes cost about half."""
        prepare_windows(self.windows, samples)

    def reserve(self, gpus: int) -> None:
        """Capacity hint: about this many GPUs will report (replay knows; the live server need not say)."""
        self.windows.reserve(gpus)

    def advance(self, now: float) -> list[Transition]:
        """Evaluate every bin that closed by `now` (sample-time seconds); returns the transitions.

        The work is bounded by the window whatever times arrive: a first call starts at most a window
        before `now` (never at an old snapshot's time), samples too old for the window are dropped and
        counted (Windows.flush), and a stretch beyond a window from any data is one silence, not a
        tick each."""
        cfg = self.config
        w = self.windows
        last_closed = math.floor((now - cfg.settle_seconds) / cfg.tick_seconds) - 1
        before = math.floor(w.newest_time / cfg.tick_seconds) if w.samples else None
        if before is None:
            if not w.pending():
                return []
            # Nothing binned yet: the first evaluation is at most a window before now, whatever the
            # oldest snapshot says (an agent's clock at the epoch, a buffer from before an outage).
            floor_bin = last_closed - w.ring + 1
            self._next_bin = floor_bin if self._next_bin is None else max(self._next_bin, floor_bin)
        # Set above on the first call, kept ever since.
        assert self._next_bin is not None
        binned = w.samples
        w.flush(min_bin=self._next_bin - w.ring + 1)
        if not w.samples:
            # No snapshot listed a GPU yet: no tick has anything to judge.
            return []
        if before is None:
            self._next_bin = max(self._next_bin, math.floor(w.resumed_time / cfg.tick_seconds))
            self._first = w.resumed_time
        newest = math.floor(w.newest_time / cfg.tick_seconds)
        out: list[Transition] = []
        k = self._next_bin
        # After a long silence of the whole cluster the windows hold nothing for those bins: skip to
        # just before the data that ended it (or to now) instead of evaluating empty ticks one by one.
        skip_from = math.inf if before is None else before + w.ring
        resumed = math.floor(w.resumed_time / cfg.tick_seconds) if w.samples > binned else last_closed + 1
        skip_to = min(resumed - 1, last_closed)
        # Past a window after the newest data every tick is the same silence: the last one speaks for it.
        quiet_from = newest + w.ring
        while k <= last_closed:
            if skip_from < k < skip_to:
                k = skip_to
            elif quiet_from < k < last_closed:
                k = last_closed
            out.extend(self._evaluate(k))
            k += 1
        self._next_bin = max(self._next_bin, last_closed + 1)
        return out

    def restore(self, alerts: Iterable[Alert]) -> int:
        """Re-seed open alerts after a restart; ids and start times are kept."""
        return self.lifecycle.restore(alerts)

    def forget_node(self, node: str, t: float, reason: str) -> list[Transition]:
        """A node no longer watched (its agent left discovery): resolve its open alerts with `reason` and
        free what the engine held about it, as if it had never reported. If it reports again, it starts
        afresh in its old slots."""
        transitions = self.lifecycle.close_node(node, t, reason)
        w = self.windows
        nid = w.node_ids.get(node)
        slots = w.forget_node(node)
        if len(slots):
            self._last_busy_t[slots[slots < len(self._last_busy_t)]] = -np.inf
            for detector, state in zip(self.detectors, self._states):
                detector.forget_node(state, slots, nid)
        return transitions

    # -- one tick -----------------------------------------------------------------------------
    def _evaluate(self, k: int) -> list[Transition]:
        """Run every detector on closed bin k."""
        # NaN is "unknown" throughout (unsupported, no data, no baseline yet), and comparisons with it
        # are simply False: the whole tick runs with numpy's warnings about it off, set once. So does an
        # excess over a spread of nearly nothing: it overflows to inf, which compares as the outlier it is.
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            return self._evaluate_tick(k)

    def _evaluate_tick(self, k: int) -> list[Transition]:
        """_evaluate's body."""
        cfg = self.config
        w = self.windows
        t = (k + 1) * cfg.tick_seconds
        smooth_bins = cfg.bins(cfg.smooth_seconds)
        held = w.held(k, max(smooth_bins, cfg.bins(cfg.gpu_lost_seconds)))
        latest, levels, fractions = read_windows(w, k, smooth_bins, held)
        med = smoothed(levels, fractions)
        has_data = np.asarray(held[:smooth_bins].any(axis=0))
        busy = med["util"] >= cfg.busy_utilization
        n = w.n
        engaged = self._engaged(t, busy, med["util"])
        loose = (w.slot_job[:n] < 0) & has_data & engaged
        gid, ngid = self.registry.build(
            t,
            w.slot_job[:n],
            w.slot_node_id[:n],
            w.slot_model_id[:n],
            w.job_names,
            has_data,
            busy,
            engaged,
            self._inference.update(k, w, loose, w.slot_model_id[:n], self._troubled) if loose.any() else None,
        )
        n_groups = len(self.registry.keys)
        if self.registry.recycled:
            self._recycle(self.registry.recycled)
        if self.registry.restarted or self.registry.recycled:
            self._restart(gid, self.registry.restarted + [g for g, _ in self.registry.recycled])
        for absorber, part in self.registry.absorbed:
            self.history.inherit(absorber, part)
        self._last_group = np.where(gid >= 0, gid, grown(self._last_group, n, -1)[:n])
        groups = group_stats(gid, ngid, n_groups, levels, fractions, self._members)
        self._members = groups.members
        self._unjudged = unjudged(busy, has_data, groups, cfg.straggler_min_group)
        if n_groups > self._dated:
            self._date_running(t, groups)
        if self._ticks % cfg.baseline_refresh_ticks == 0 or self.history.base.shape[1] < n_groups:
            self.history.refresh(k, n_groups)
        self._regime(groups)
        drop, source = workload.job_drop(groups, self.history, cfg)
        tick = Tick(
            k=k,
            t=t,
            config=cfg,
            windows=w,
            latest=latest,
            med=med,
            levels=levels,
            has_data=has_data,
            groups=groups,
            registry=self.registry,
            slowdown=drop,
            slowdown_source=source,
            slowdown_baselines=(self.history.baseline("sm"), self.history.baseline("power")),
            held=held,
            sag=workload.sag(groups, self.history, drop, source),
        )
        outcomes, context = self._detect(tick, w.drain_events())
        severity.grade(outcomes, cfg)
        self._troubled = self._inferred_in_trouble(tick, set(context.singled_out))
        transitions = self.lifecycle.step(t, outcomes)
        self._count_losses(outcomes)
        if self._ticks % cfg.index_prune_ticks == 0:
            keep = set(self.lifecycle.records)
            for detector, state in zip(self.detectors, self._states):
                detector.prune(state, keep, cfg)
        self._record_history(tick, context.explained, outcomes)
        self._ticks += 1
        self._last_t = t
        self._last_tick = tick
        return transitions

    def _detect(self, tick: Tick, events: Sequence[CounterEvent]) -> tuple[dict[AlertKind, Outcome], Context]:
        """Run the detectors in order, each reading what the ones before it concluded (the context)."""
        outcomes: dict[AlertKind, Outcome] = {}
        context = Context(
            history=self.history,
            alerts=self.lifecycle,
            last_busy_time=self._last_busy_t,
            last_group=self._last_group,
            events=events,
        )
        for detector, state in zip(self.detectors, self._states):
            found = detector.detect(tick, state, context)
            outcomes.update(found.outcomes)
            context = joined(context, found)
        return outcomes, context

    def _inferred_in_trouble(self, tick: Tick, standout: set[int]) -> np.ndarray | None:
        """Per slot: its group is unattributed (an inferred job or a fallback) and its peers slowed or
        someone stands out or is named. Its GPU model is not re-inferred meanwhile (see
        inference.JobInference): an incident disturbs how a job's GPUs move, and clusters formed then are
        fragments of it. Named counts apart from standing out: a GPU named by its cut clocks before it
        has learned stands out from nothing yet, and an inference left that braked GPU alone."""
        grp, cfg = tick.groups, self.config
        inferred = ~self.registry.is_job[: grp.n_groups]
        if not inferred.any():
            return None
        min_drop = np.where(
            tick.slowdown_source == SlowdownSource.POWER, cfg.straggler_min_power_drop, cfg.straggler_min_slowdown
        )
        trouble = inferred & (tick.slowdown >= min_drop)
        if standout:
            trouble[[g for g in standout if g < grp.n_groups and inferred[g]]] = True
        gid = grp.gid
        return (gid >= 0) & trouble[np.maximum(gid, 0)]

    def _count_losses(self, outcomes: dict[AlertKind, Outcome]) -> None:
        """Add this tick's GPU-hours lost to each job whose problem has a firing alert: the largest cost
        among its firing findings, put down to that finding's kind. Two stragglers of one job each
        estimate the same job-wide loss; summed, the job would lose more than its GPUs' time. Pending
        findings count nothing: a condition that never fires is not a problem the job had."""
        records = self.lifecycle.records
        worst: dict[str, tuple[float, AlertKind]] = {}
        for kind in self._costing:
            for fp, f in outcomes[kind].findings.items():
                rec = records.get(fp)
                cost = f.cost_gpu_hours
                if f.hpc_job is None or rec is None or rec.state is not AlertState.FIRING or not math.isfinite(cost):
                    continue
                if cost > worst.get(f.hpc_job, (0.0, kind))[0]:
                    worst[f.hpc_job] = (cost, kind)
        for job, (cost, kind) in worst.items():
            lost = self._job_lost.setdefault(job, {})
            lost[kind] = lost.get(kind, 0.0) + cost

    def _date_running(self, t: float, groups) -> None:
        """Groups first seen in the engine's first moments, already spinning at full utilization, were
        running before the engine started (a trace cut from a longer recording, a server restarted
        mid-job): their start-up is behind them, so they are dated back by the start-up grace.

        Otherwise the first 45 s of such a job were kept out of its baseline as start-up, its GPUs were
        judged only after 90 s and its job-level drops only after 210 s. An incident in a trace's first
        minutes then went unreported, or was named minutes late: a communication slowdown from +30 s
        never, one from +120 s after 122 s; a silently slow GPU from +30 s never, since the job's
        baseline learned only the slowed job. A job that starts while the engine watches begins idle
        (its processes load before any kernel runs) and keeps its start-up grace; so does an
        unattributed group restarted because its busy GPUs changed (not a new group).
        """
        cfg = self.config
        new = np.arange(self._dated, groups.n_groups)
        self._dated = groups.n_groups
        if self._first is None or t - self._first > cfg.startup_grace_seconds * cfg.running_at_start_ratio:
            return
        running = new[groups.util[new] >= cfg.straggler_waiting_utilization]
        if len(running):
            self.registry.backdate(running, cfg.startup_grace_seconds)

    def _restart(self, gid: np.ndarray, gids: list[int]) -> None:
        """Forget what was learned about groups whose work changed (see GroupRegistry._build)."""
        restarted = np.array(gids, dtype=np.int64)
        self.history.reset(restarted[restarted < self.history.base.shape[1]])
        slots = np.flatnonzero(np.isin(gid, restarted) & ~self.registry.carried[: len(gid)])
        for detector, state in zip(self.detectors, self._states):
            detector.restart(state, slots)

    def _recycle(self, recycled: list[tuple[int, tuple]]) -> None:
        """Drop what is keyed by the groups whose ids went to new groups (the rest is in _restart)."""
        for gid, old in recycled:
            if old[0] == JOB:
                self._job_ticks.pop(old[1], None)
                self._job_lost.pop(old[1], None)
            if gid < len(self._regime_ticks):
                self._regime_ticks[gid] = 0
            for detector, state in zip(self.detectors, self._states):
                detector.recycle(state, gid, old, self.registry, self.windows)
        self._members = None

    def _engaged(self, t: float, busy: np.ndarray, util: np.ndarray) -> np.ndarray:
        """Per slot: busy at some evaluation within the last unattributed_idle_seconds, and running kernels
        now (utilization at least unattributed_running_utilization).

        A job's rank, however starved by its host, runs kernels in every step. A GPU running none has no
        job, whatever it ran minutes ago: kept in the comparison, GPUs released by a job that ended would
        drag their node's median towards idle, and a host-starved node beside them would not stand out."""
        n = len(busy)
        self._last_busy_t = grown(self._last_busy_t, n, -np.inf)
        last = self._last_busy_t[:n]
        last[busy] = t
        cfg = self.config
        return (t - last <= cfg.unattributed_idle_seconds) & ~(util < cfg.unattributed_running_utilization)

    def _regime(self, groups) -> None:
        """A group whose clocks moved away from their baseline for a minute (a power cap set or lifted,
        application clocks changed) starts a new baseline instead of reading the change as a slowdown."""
        cfg = self.config
        n = groups.n_groups
        self._regime_ticks = grown(self._regime_ticks, n, 0)
        base_clk = self.history.baseline("clock")[:n]
        moved = np.abs(groups.clock / base_clk - 1.0) > 1.0 - cfg.workload_clock_ratio
        ticks = np.where(moved, self._regime_ticks[:n] + 1, 0)
        changed = ticks >= cfg.bins(cfg.regime_change_seconds)
        if changed.any():
            self.history.reset(np.flatnonzero(changed))
            ticks[changed] = 0
        self._regime_ticks[:n] = ticks

    def _record_history(self, tick: Tick, suppressed: AbstractSet[int], outcomes: dict[AlertKind, Outcome]) -> None:
        """Store this tick in the group history; only healthy ticks feed baselines."""
        cfg = self.config
        grp = tick.groups
        threshold = np.where(tick.slowdown_source == SlowdownSource.POWER, cfg.workload_power_drop, cfg.workload_drop)
        # Ticks well below the history's median stay out of it: a cut measured from the baseline (a high
        # percentile) would fall inside a noisy job's ordinary range, keep only its upper levels and so
        # raise the baseline further.
        healthy = (
            (grp.util >= cfg.job_active_utilization)
            & ~(tick.sag >= threshold * cfg.history_max_sag_ratio)
            & (
                tick.t - self.registry.first_seen[: grp.n_groups]
                >= cfg.startup_grace_seconds * cfg.startup_history_ratio
            )
        )
        for g in suppressed:
            healthy[g] = False
        self.history.record(tick.k, grp, healthy)
        comm = (
            {f.hpc_job for f in outcomes[AlertKind.COMM_BOUND].findings.values()}
            if AlertKind.COMM_BOUND in outcomes
            else set()
        )
        for gid in (grp.size > 0).nonzero()[0].tolist():
            job = self.registry.job(gid)
            if job is not None:
                counts = self._job_ticks.setdefault(job, [0, 0])
                counts[0] += 1
                counts[1] += job in comm

    def state(self, detector: str) -> Any:
        """What a detector (by name) has learned so far: its state, for inspection (KeyError if not run)."""
        for d, state in zip(self.detectors, self._states):
            if d.name == detector:
                return state
        raise KeyError(detector)

    # -- views --------------------------------------------------------------------------------
    def alerts(self) -> list[Alert]:
        """Pending and firing alerts."""
        return self.lifecycle.alerts()

    def jobs(self) -> list[JobHealth]:
        """Per-job health at the latest evaluation."""
        tick = self._last_tick
        if tick is None:
            return []
        w, grp = self.windows, tick.groups
        open_alerts = self.lifecycle.alerts()
        out = []
        base_sm = self.history.baseline("sm")
        for gid in np.flatnonzero(grp.size > 0).tolist():
            job = self.registry.job(gid)
            if job is None:
                continue
            members = np.flatnonzero(grp.gid == gid)
            mine = [a for a in open_alerts if a.hpc_job == job and a.state is AlertState.FIRING]
            counts = self._job_ticks.get(job, [0, 0])
            lost = self._job_lost.get(job, {})
            out.append(
                JobHealth(
                    hpc_job=job,
                    gpus=int(grp.size[gid]),
                    nodes=tuple(sorted({w.slot_node[s] for s in members.tolist()})),
                    utilization_ratio=_f(grp.util[gid]),
                    sm_active_ratio=_f(grp.sm[gid]),
                    baseline_sm_active_ratio=_f(base_sm[gid]) if gid < len(base_sm) else None,
                    power_watts=_f(grp.power[gid]),
                    estimated_slowdown_ratio=_f(tick.slowdown[gid]),
                    stragglers=tuple({"node": a.node, "gpu": a.gpu} for a in mine if a.kind == AlertKind.STRAGGLER),
                    comm_bound=any(a.kind == AlertKind.COMM_BOUND for a in mine),
                    input_bound=any(a.kind == AlertKind.INPUT_BOUND for a in mine),
                    comm_bound_share=counts[1] / counts[0] if counts[0] else 0.0,
                    evaluated_ticks=counts[0],
                    gpu_hours_lost_by_kind=tuple(
                        (kind.value, round(lost[kind], VIEW_DIGITS)) for kind in self._costing if kind in lost
                    ),
                )
            )
        return sorted(out, key=lambda j: j.hpc_job)

    def nodes(self) -> list[NodeHealth]:
        """Per-node health at the latest evaluation."""
        w = self.windows
        open_alerts = self.lifecycle.alerts()
        unreachable = {a.node for a in open_alerts if a.kind == AlertKind.NODE_UNREACHABLE}
        out = []
        node_ids = w.slot_node_id[: w.n]
        for nid, node in enumerate(w.node_names):
            last = w.node_last_time[nid]
            if last != last:
                continue  # forgotten (forget_node) and not heard from since
            slots = np.flatnonzero(node_ids == nid)
            jobs = sorted({w.job_names[c] for c in w.slot_job[slots].tolist() if c >= 0})
            mine = slots[slots < len(self._unjudged)]
            out.append(
                NodeHealth(
                    node=node,
                    gpus=len(slots),
                    reachable=node not in unreachable,
                    last_sample_time=_f(last),
                    lag_seconds=None if self._last_t is None or last != last else max(0.0, self._last_t - float(last)),
                    hpc_jobs=tuple(jobs),
                    open_alerts=sum(1 for a in open_alerts if a.node == node),
                    unjudged_gpus=int(self._unjudged[mine].sum()),
                )
            )
        return out

    def stats(self) -> EngineStats:
        """Counters about the engine itself."""
        alerts = self.lifecycle.alerts()
        return EngineStats(
            samples_ingested=self.windows.samples,
            late_samples_dropped=self.windows.late_dropped,
            too_old_snapshots_dropped=self.windows.too_old_dropped,
            pending_samples=self.windows.pending(),
            ticks=self._ticks,
            last_tick_time=self._last_t,
            gpus=self.windows.n,
            nodes=len(self.windows.node_names),
            jobs=sum(1 for j in self.windows.job_names),
            open_alerts=len(alerts),
            firing_alerts=sum(1 for a in alerts if a.state is AlertState.FIRING),
            gpus_unjudged=self.unjudged_gpus(),
        )

    def unjudged_gpus(self) -> int:
        """Busy GPUs at the latest evaluation that no peer group could judge (see unjudged()); a GPU of a
        node forgotten since is not counted."""
        w = self.windows
        live = ~np.isnan(w.node_last_time[w.slot_node_id[: len(self._unjudged)]])
        return int((self._unjudged & live).sum())


def unjudged(busy: np.ndarray, has_data: np.ndarray, groups, min_group: int) -> np.ndarray:
    """Per slot: a busy GPU with no peer group of at least min_group GPUs with data (a job alone on its
    GPU, an unattributed GPU alone with its model on its node and in no inferred job). No straggler
    comparison can name it; counted so that the blind spot is seen, not silent."""
    gid = groups.gid
    sized = np.where(gid >= 0, groups.size[np.maximum(gid, 0)], 0) if len(groups.size) else np.zeros(len(gid))
    return busy & has_data & (sized < min_group)


def _f(x: float) -> float | None:
    """Plain float or None for NaN."""
    return None if x != x else round(float(x), VIEW_DIGITS)
