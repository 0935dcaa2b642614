"""What the pages draw: a short, bounded history read from the engine's windows after each cycle.

The engine keeps only a window of bins; a person asks what the last hour looked like. After each cycle
the runtime hands the engine to ChartHistory.observe(), which reads the newest bins of the few GPUs it
needs (never a detector's state, and nothing is written back: detection stays a pure function of its
samples) and returns an immutable Charts for the FleetView:

- each job's SM activity, its GPUs' median and 25th-75th percentile, as one-minute points over an hour;
- for each open alert, its subject's readings against its peers' (the job's other GPUs) median and band:
  the window's bins at tick resolution, and one-minute points from before the window;
- the fleet now: each GPU's temperature and SM activity relative to its job's median, or per node (the
  hottest GPU, the one farthest from its job) once the fleet has more than FLEET_GPU_CELLS GPUs.

Memory is bounded whatever the fleet: at most MAX_JOBS jobs x POINTS points x 4 floats (about 11 MB as
Python tuples at 1,000 jobs, and the columns the pages read share those floats) and MAX_SUBJECTS alerts
x POINTS points x 9 floats; a series not fed for POINTS minutes is dropped, and beyond the caps the least
recently fed goes first. Per cycle the work is one pass over every GPU's newest bins (the job statistics
and the fleet view, numpy-vectorised) and, for at most MAX_CHARTED_ALERTS open alerts, a window of the
alert's GPU and its peers.
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from gpufleet.server.alerts import Alert, AlertKind, AlertState
from gpufleet.server.engine import series
from gpufleet.server.engine.windows import Windows

STEP_SECONDS = 60.0
POINTS = 60  # one hour of one-minute points
MAX_JOBS = 1000
MAX_SUBJECTS = 64
MAX_CHARTED_ALERTS = 32  # open alerts whose window is read each cycle (firing first, newest first)
FLEET_GPU_CELLS = 1024  # above this many GPUs the fleet view shows one cell per node
RECENT_BINS = 3  # the fleet view's "now": the mean of each GPU's newest bins, as a sample may miss one
SM = "sm_active_ratio"
# Besides SM activity, the reading that shows what the alert is about.
SECOND_READING = {
    AlertKind.THERMAL_THROTTLE: "temperature_celsius",
    AlertKind.STRAGGLER: "power_watts",
}
DEFAULT_SECOND_READING = "utilization_ratio"
MIN_PEERS_FOR_QUARTILES = 4  # fewer peers: the band is their min-max


@dataclass(frozen=True, slots=True)
class Series:
    """One reading over time: the subject's line (empty for a whole job) and its peers' median and band."""

    reading: str  # a row name of server/readings.py, its unit in the name
    times: tuple[float, ...]  # sample-time seconds
    subject: tuple[float, ...]  # NaN where absent; empty when there is no single subject
    median: tuple[float, ...]
    low: tuple[float, ...]
    high: tuple[float, ...]
    peers: int = 0
    band: str = "25th-75th percentile"


@dataclass(frozen=True, slots=True)
class AlertChart:
    """An alert's subject against its peers."""

    alert_id: str
    series: tuple[Series, ...]
    window_start: float | None = None  # before this, one-minute points; from it, the window's bins


@dataclass(frozen=True, slots=True)
class FleetCell:
    """One GPU, or one node's GPUs together (gpu None)."""

    node: str
    gpu: int | None
    gpus: int
    job: str | None
    temperature_celsius: float  # NaN when unknown; per node, the hottest
    sm_vs_job_ratio: float  # SM activity over its job's median; per node, the farthest from 1


@dataclass(frozen=True, slots=True)
class Charts:
    """Everything the pages draw, as plain values."""

    jobs: dict[str, Series] = field(default_factory=dict)
    alerts: dict[str, AlertChart] = field(default_factory=dict)
    fleet: tuple[FleetCell, ...] = ()
    fleet_per_node: bool = False
    evaluated_at: float | None = None


class Downsampled:
    """Points of several values averaged over STEP_SECONDS (NaN skipped), the newest POINTS kept."""

    def __init__(self, width: int) -> None:
        self.points: deque[tuple[float, ...]] = deque(maxlen=POINTS)
        self._bucket: int | None = None
        self._sum = np.zeros(width + 1)  # the time first, then the values
        self._n = np.zeros(width + 1)
        self.last_time = -math.inf
        self._columns: list[tuple[float, ...]] | None = None  # the closed points by column, built once each

    def add(self, t: float, values: Sequence[float]) -> None:
        bucket = math.floor(t / STEP_SECONDS)
        if bucket != self._bucket:
            self._close()
            self._bucket = bucket
        row = np.array([t, *values], dtype=np.float64)
        ok = ~np.isnan(row)
        self._sum += np.where(ok, row, 0.0)
        self._n += ok
        self.last_time = t

    def _close(self) -> None:
        if self._n[0]:
            self.points.append(self._partial())
            self._columns = None
        self._sum[:] = 0.0
        self._n[:] = 0.0

    def _partial(self) -> tuple[float, ...]:
        with np.errstate(invalid="ignore", divide="ignore"):
            return tuple((self._sum / self._n).tolist())

    def snapshot(self, before: float = math.inf) -> list[tuple[float, ...]]:
        """The points, the current minute's partial mean last, those at or after `before` left out."""
        out = list(self.points)
        if self._n[0]:
            out.append(self._partial())
        return [p for p in out if p[0] < before]

    def columns(self) -> list[tuple[float, ...]]:
        """The snapshot by column (times, then each value), the closed points' columns reused until one closes."""
        if self._columns is None:
            self._columns = [tuple(col) for col in zip(*self.points)] or [() for _ in self._sum]
        if not self._n[0]:
            return self._columns
        return [col + (v,) for col, v in zip(self._columns, self._partial())]


class ChartHistory:
    """Fed once per cycle on the engine's thread; owns the bounded series behind the pages' charts."""

    def __init__(self) -> None:
        self._jobs: OrderedDict[str, Downsampled] = OrderedDict()
        self._alerts: OrderedDict[str, Downsampled] = OrderedDict()
        self._alert_charts: dict[str, AlertChart] = {}
        self._last_bin: int | None = None
        self._charts = Charts()

    def observe(self, engine: Any, alerts: Iterable[Alert]) -> Charts:
        """Read the latest evaluation's bins; the same Charts again while no new bin closed."""
        w = getattr(engine, "windows", None)
        if not isinstance(w, Windows):
            return self._charts  # an engine without windows (a test's stub) has nothing to draw
        tick = float(engine.config.tick_seconds)
        last = series.last_bin(tick, engine.stats().last_tick_time)
        if last is None or w.n == 0 or last == self._last_bin:
            return self._charts
        self._last_bin = last
        t = (last + 1) * tick
        now = _recent_means(w, last)
        self._feed_jobs(w, t, now[0])
        charted = self._chart_alerts(w, last, tick, alerts)
        self._expire(t)
        cells, per_node = fleet_cells(w, now[0], now[1])
        self._charts = Charts(
            jobs={job: _job_series(d) for job, d in self._jobs.items()},
            alerts={**self._resolved_charts(charted), **charted},
            fleet=cells,
            fleet_per_node=per_node,
            evaluated_at=t,
        )
        return self._charts

    def _feed_jobs(self, w: Windows, t: float, sm: np.ndarray) -> None:
        codes = w.slot_job[: w.n]
        for code, stats in job_quantiles(codes, sm).items():
            job = w.job_names[code]
            d = self._jobs.pop(job, None) or Downsampled(3)
            d.add(t, stats)
            self._jobs[job] = d  # most recently fed last
        while len(self._jobs) > MAX_JOBS:
            self._jobs.popitem(last=False)

    def _chart_alerts(self, w: Windows, last: int, tick: float, alerts: Iterable[Alert]) -> dict[str, AlertChart]:
        shown = sorted(
            (a for a in alerts if a.state is not AlertState.RESOLVED),
            key=lambda a: (a.state is not AlertState.FIRING, -a.pending_since),
        )[:MAX_CHARTED_ALERTS]
        out = {}
        for alert in shown:
            window = alert_window(w, last, tick, alert)
            if window is None:
                continue
            d = self._alerts.pop(alert.id, None) or Downsampled(8)
            d.add(
                window[0].times[-1], [v for s in window for v in (s.subject[-1], s.median[-1], s.low[-1], s.high[-1])]
            )
            self._alerts[alert.id] = d
            out[alert.id] = AlertChart(alert.id, _merged(window, d), window_start=window[0].times[0])
        while len(self._alerts) > MAX_SUBJECTS:
            self._alerts.popitem(last=False)
        self._alert_charts = {**self._alert_charts, **out}
        return out

    def _resolved_charts(self, charted: dict[str, AlertChart]) -> dict[str, AlertChart]:
        """Alerts no longer read from the window (resolved, or beyond the cap): their one-minute points."""
        out = {}
        for alert_id, d in self._alerts.items():
            if alert_id in charted or alert_id not in self._alert_charts:
                continue
            old = self._alert_charts[alert_id].series
            out[alert_id] = AlertChart(alert_id, _merged(tuple(_empty(s) for s in old), d))
        return out

    def _expire(self, t: float) -> None:
        horizon = t - POINTS * STEP_SECONDS
        for store in (self._jobs, self._alerts):
            for key in [k for k, d in store.items() if d.last_time < horizon]:
                del store[key]
        self._alert_charts = {k: v for k, v in self._alert_charts.items() if k in self._alerts}


def _recent_means(w: Windows, last: int) -> np.ndarray:
    """(SM activity, temperature) per GPU, the mean of its newest RECENT_BINS bins."""
    data = series.bin_means(w, last, RECENT_BINS, (SM, "temperature_celsius"), np.arange(w.n))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(data, axis=0)


def job_quantiles(codes: np.ndarray, values: np.ndarray) -> dict[int, tuple[float, float, float]]:
    """Per job code: the (median, 25th, 75th percentile) of its GPUs' values, NaN and NO_JOB left out;
    numpy's linear interpolation, for every job in one pass."""
    keep = (codes >= 0) & ~np.isnan(values)
    c, v = codes[keep], values[keep]
    if not len(c):
        return {}
    order = np.lexsort((v, c))
    c, v = c[order], v[order]
    starts = np.flatnonzero(np.r_[True, c[1:] != c[:-1]])
    last = np.r_[starts[1:], len(c)] - 1
    cols = []
    for q in (0.5, 0.25, 0.75):
        pos = starts + q * (last - starts)
        below = np.floor(pos).astype(np.int64)
        above = np.minimum(below + 1, last)
        cols.append(v[below] + (pos - below) * (v[above] - v[below]))
    return {code: (m, lo, hi) for code, m, lo, hi in zip(c[starts].tolist(), *(col.tolist() for col in cols))}


def alert_window(w: Windows, last: int, tick: float, alert: Alert) -> tuple[Series, ...] | None:
    """The alert's subject and its peers over the window's bins, None when the windows know neither."""
    subject = series.slot_of(w, alert.node, alert.gpu) if alert.gpu is not None else None
    if alert.hpc_job:
        peers = series.job_slots(w, alert.hpc_job)
    elif alert.node in w.node_ids:
        peers = np.flatnonzero(w.slot_node_id[: w.n] == w.node_ids[alert.node])
    else:
        peers = np.empty(0, dtype=np.int64)
    peers = peers[peers != subject] if subject is not None else peers
    if subject is None and not len(peers):
        return None
    readings = (SM, SECOND_READING.get(alert.kind, DEFAULT_SECOND_READING))
    slots = np.r_[[subject] if subject is not None else [], peers].astype(np.int64)
    data = series.bin_means(w, last, w.ring, readings, slots)  # (bins, readings, slots)
    times = tuple(((last - np.arange(data.shape[0])[::-1] + 1) * tick).tolist())
    own = data[:, :, 0] if subject is not None else None
    rest = data[:, :, 1:] if subject is not None else data
    quartiles = len(peers) >= MIN_PEERS_FOR_QUARTILES
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        med = np.nanmedian(rest, axis=2) if len(peers) else np.full(data.shape[:2], np.nan)
        lo = (np.nanpercentile(rest, 25, axis=2) if quartiles else np.nanmin(rest, axis=2)) if len(peers) else med
        hi = (np.nanpercentile(rest, 75, axis=2) if quartiles else np.nanmax(rest, axis=2)) if len(peers) else med
    return tuple(
        Series(
            reading=name,
            times=times,
            subject=tuple(own[:, i].tolist()) if own is not None else tuple(math.nan for _ in times),
            median=tuple(med[:, i].tolist()),
            low=tuple(lo[:, i].tolist()),
            high=tuple(hi[:, i].tolist()),
            peers=len(peers),
            band="25th-75th percentile" if quartiles else "min-max",
        )
        for i, name in enumerate(readings)
    )


def _merged(window: tuple[Series, ...], d: Downsampled) -> tuple[Series, ...]:
    """One-minute points from before the window, then the window's bins."""
    start = window[0].times[0] if window[0].times else math.inf
    older = d.snapshot(before=start)
    out = []
    for i, s in enumerate(window):
        cols = [tuple(p[1 + 4 * i + j] for p in older) for j in range(4)]
        out.append(
            Series(
                reading=s.reading,
                times=tuple(p[0] for p in older) + s.times,
                subject=cols[0] + s.subject,
                median=cols[1] + s.median,
                low=cols[2] + s.low,
                high=cols[3] + s.high,
                peers=s.peers,
                band=s.band,
            )
        )
    return tuple(out)


def _empty(s: Series) -> Series:
    return Series(s.reading, (), (), (), (), (), s.peers, s.band)


def _job_series(d: Downsampled) -> Series:
    times, median, low, high = d.columns()
    return Series(reading=SM, times=times, subject=(), median=median, low=low, high=high)


def fleet_cells(w: Windows, sm: np.ndarray, temp: np.ndarray) -> tuple[tuple[FleetCell, ...], bool]:
    """The fleet view's cells, one per GPU, or one per node past FLEET_GPU_CELLS GPUs."""
    n = w.n
    codes = w.slot_job[:n]
    medians = {code: q[0] for code, q in job_quantiles(codes, sm).items()}
    job_median = np.array([medians.get(c, math.nan) for c in codes.tolist()])
    with np.errstate(invalid="ignore", divide="ignore"):
        relative = np.where(job_median > 0, sm / job_median, np.nan)
    alive = ~np.isnan(w.node_last_time[w.slot_node_id[:n]])
    slots = np.flatnonzero(alive)
    per_node = len(slots) > FLEET_GPU_CELLS
    name = w.job_names
    if not per_node:
        cells = [
            FleetCell(
                node=w.slot_node[s],
                gpu=w.slot_index[s],
                gpus=1,
                job=name[codes[s]] if codes[s] >= 0 else None,
                temperature_celsius=float(temp[s]),
                sm_vs_job_ratio=float(relative[s]),
            )
            for s in slots.tolist()
        ]
        return tuple(sorted(cells, key=lambda c: (c.node, c.gpu or 0))), False
    return _node_cells(w, slots, temp, relative), True


def _node_cells(w: Windows, slots: np.ndarray, temp: np.ndarray, relative: np.ndarray) -> tuple[FleetCell, ...]:
    """One cell per node: its hottest GPU's temperature, and the SM ratio farthest from its job's median;
    every node in one pass over the GPUs."""
    nid = w.slot_node_id[slots]
    order = np.lexsort((np.nan_to_num(np.abs(relative[slots] - 1.0), nan=-1.0), nid))
    slots, nid = slots[order], nid[order]  # by node, and within it the farthest from its job last
    starts = np.flatnonzero(np.r_[True, nid[1:] != nid[:-1]])
    ends = np.r_[starts[1:], len(slots)]
    hottest = np.fmax.reduceat(temp[slots], starts)
    farthest = relative[slots[ends - 1]]
    codes = w.slot_job[slots]
    width = len(w.job_names) + 1
    jobs: dict[int, list[str]] = {}
    for key in np.unique(nid[codes >= 0] * width + codes[codes >= 0]).tolist():
        jobs.setdefault(key // width, []).append(w.job_names[key % width])
    cells = [
        FleetCell(
            node=w.node_names[node_id],
            gpu=None,
            gpus=int(end - start),
            job=", ".join(sorted(jobs.get(node_id, ()))) or None,
            temperature_celsius=float(hot),
            sm_vs_job_ratio=float(far),
        )
        for node_id, start, end, hot, far in zip(
            nid[starts].tolist(), starts.tolist(), ends.tolist(), hottest.tolist(), farthest.tolist()
        )
    ]
    return tuple(sorted(cells, key=lambda c: c.node))
