"""Per-GPU time windows: samples averaged into fixed tick bins held in preallocated numpy rings.

Ingest only appends to an inbox; `flush()` moves every pending sample into the rings in one
vectorised pass (per-sample Python work is a couple of dict lookups per node snapshot). Cumulative
counters (energy, XID, ECC) are differenced per GPU in time order, robust to resets (a counter that went
backwards restarts from zero), wraps, gaps and late samples (older than the GPU's newest: ignored for
rates, still binned). Bins are keyed by sample time, so a node's clock skew only shifts its own bins.

Replay knows every sample up front and says so with server.engine.prepared.prepare_windows(): the
per-row work is then done for many ticks at once, while each flush still applies only its own samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from types import MappingProxyType
from typing import Mapping, Protocol

import numpy as np

from gpufleet.reasons import CLOCK_CUT_REASONS, THERMAL_REASONS, ThrottleReason
from gpufleet.server.contract import COLUMN, NodeSample
from gpufleet.server.readings import READINGS, Reading, Window

# Rows the windows compute from several readings, after the readings binned as they are.
DERIVED_ROWS = ("clock_ratio", "thermal", "hw_thermal", "slow", "power_cap")


def binned_rows(table: tuple[Reading, ...]) -> tuple[str, ...]:
    """Names of the rings' rows: every Window.ROW reading of the table, then the derived rows."""
    return tuple(r.name for r in table if r.window is Window.ROW) + DERIVED_ROWS


def held_rows(table: tuple[Reading, ...]) -> tuple[str, ...]:
    """Names of Windows.slot_limits' rows: the device constants, kept newest per GPU."""
    return tuple(r.name for r in table if r.window is Window.HELD)


def event_counters(table: tuple[Reading, ...]) -> tuple[Reading, ...]:
    """The health counters whose increases become CounterEvents."""
    return tuple(r for r in table if r.window is Window.EVENTS)


# Binned quantities (rows of the rings), by name; a detector takes its rows from here once, at import.
ROWS = binned_rows(READINGS)
ROW: Mapping[str, int] = MappingProxyType({name: i for i, name in enumerate(ROWS)})
N_BINNED = len(ROWS)
B_UP = ROW["up"]
B_UTIL = ROW["utilization_ratio"]
B_SM = ROW["sm_active_ratio"]
B_TEMP = ROW["temperature_celsius"]
B_MEM_TEMP = ROW["memory_temperature_celsius"]
B_POWER = ROW["power_watts"]
B_POWER_LIMIT = ROW["power_limit_watts"]
B_REMAP_PENDING = ROW["remapped_rows_pending"]
B_REMAP_FAILURE = ROW["remapped_rows_failure"]
B_CLOCK_RATIO = ROW["clock_ratio"]
B_THERMAL = ROW["thermal"]
B_HW_THERMAL = ROW["hw_thermal"]
B_SLOW = ROW["slow"]
B_POWER_CAP = ROW["power_cap"]
# The readings binned as they are fill the rings' first rows, in table order: one slice of the output.
_N_DIRECT = N_BINNED - len(DERIVED_ROWS)
_DIRECT_COLS = np.array([COLUMN[name] for name in ROWS[:_N_DIRECT]])
# Readings the derived rows and the counters are computed from.
CLOCK = COLUMN["sm_clock_hertz"]
CLOCK_MAX = COLUMN["sm_clock_max_hertz"]
THROTTLE = COLUMN["throttle_reasons"]
ENERGY = COLUMN["energy_joules_total"]
LAST_XID = COLUMN["last_xid"]
# A device's temperature limits do not change while it runs: the newest one reported is kept per GPU
# (Windows.slot_limits) instead of a ring of bins, which at 8,000 GPUs and 10-minute windows would
# hold 16 MB per limit. Rows of slot_limits:
HELD = held_rows(READINGS)
L_SLOWDOWN = HELD.index("slowdown_temperature_celsius")
L_MEM_MAX = HELD.index("memory_max_operating_temperature_celsius")
LIMIT_COLS = np.array([COLUMN[name] for name in HELD])
THERMAL_BITS = int(THERMAL_REASONS)
HW_THERMAL_BIT = int(ThrottleReason.HW_THERMAL_SLOWDOWN)
SLOW_BITS = int(CLOCK_CUT_REASONS | ThrottleReason.SW_THERMAL_SLOWDOWN)
POWER_CAP_BIT = int(ThrottleReason.SW_POWER_CAP)
# _counters' column i is counter i: energy (differenced into power), then the health counters, whose
# increases are events of _EVENT_KINDS[i].
_EVENTS = event_counters(READINGS)
_COUNTER_COLS = np.array([ENERGY] + [COLUMN[r.name] for r in _EVENTS])
_EVENT_KINDS = ("",) + tuple(str(r.event) for r in _EVENTS)
_HEALTH_COUNTERS = tuple(range(1, len(_COUNTER_COLS)))
_XID_COUNTER = _EVENT_KINDS.index("xid")
_BIT_ROWS = np.array([B_THERMAL, B_HW_THERMAL, B_SLOW, B_POWER_CAP])
_BIT_MASKS = np.array([THERMAL_BITS, HW_THERMAL_BIT, SLOW_BITS, POWER_CAP_BIT])[:, None]
NO_JOB = -1
_TIME_NODE = attrgetter("time", "node")


@dataclass(frozen=True, slots=True)
class CounterEvent:
    """A cumulative health counter that increased on one GPU."""

    slot: int
    time: float
    kind: str  # its counter's event kind (server/readings.py): "xid" or "ecc"
    delta: int
    codes: tuple[int, ...]


class _NodeCache:
    """What a node's previous snapshot resolved to, reused while its GPU list is unchanged."""

    __slots__ = ("indices", "uuids", "slots", "jobs", "job_codes")

    def __init__(self) -> None:
        self.indices: tuple = ()
        self.uuids: tuple = ()
        self.slots = np.empty(0, dtype=np.int64)
        self.jobs: tuple = ()
        self.job_codes = np.empty(0, dtype=np.int64)


class PreparedFlushes(Protocol):
    """What flush() hands its samples to once they were promised up front: server.engine.prepared's
    Prepared, which works on this module's internals and so imports it (never the other way round)."""

    def flush(self, inbox: list[NodeSample], min_bin: int) -> None: ...


class Windows:
    """Slot registry (one slot per node/GPU index) plus binned rings and counter state."""

    # Per-slot (last axis) arrays, reallocated by _grow as slots are added.
    acc: np.ndarray
    bin_id: np.ndarray
    slot_job: np.ndarray
    slot_job_since: np.ndarray
    slot_last_job: np.ndarray
    slot_last_time: np.ndarray
    slot_node_id: np.ndarray
    slot_model_id: np.ndarray
    _counter_val: np.ndarray
    _counter_time: np.ndarray
    slot_limits: np.ndarray

    def __init__(self, tick_seconds: float, ring_bins: int) -> None:
        self.tick = float(tick_seconds)
        self.ring = int(ring_bins)
        self.n = 0
        self._cap = 0
        # Looked up with a finding's subject too, whose node or GPU may be None (no slot then).
        self.slot_of: dict[tuple[str | None, int | None], int] = {}
        self.slot_node: list[str] = []
        self.slot_index: list[int] = []
        self.slot_uuid: list[str] = []
        self.slot_model: list[str] = []
        self.node_ids: dict[str, int] = {}
        self.node_names: list[str] = []
        self.model_ids: dict[str, int] = {}
        self.job_codes: dict[str, int] = {}
        self.job_names: list[str] = []
        self.node_last_time = np.full(0, np.nan)
        self._nodes: dict[str, _NodeCache] = {}
        self._inbox: list[NodeSample] = []
        self.events: list[CounterEvent] = []
        self._xid_maps: dict[int, dict[int, int]] = {}
        self.samples = 0
        self.late_dropped = 0
        self.too_old_dropped = 0  # snapshots older than the window, never binned
        self.newest_time = -np.inf
        self.resumed_time = -np.inf
        self._prepared: PreparedFlushes | None = None
        self._grow(64)

    # -- registry -----------------------------------------------------------------------------
    def _grow(self, need: int) -> None:
        """Double capacity until `need` slots fit, keeping contents."""
        cap = max(self._cap, 64)
        while cap < need:
            cap *= 2
        if cap == self._cap:
            return
        old = self._cap

        def grow(arr: np.ndarray | None, fill: float, shape_prefix: tuple = (), dtype=np.float64) -> np.ndarray:
            # Zeros come from calloc: the rings' pages are only touched where a sample lands.
            new = (
                np.zeros(shape_prefix + (cap,), dtype=dtype)
                if fill == 0
                else np.full(shape_prefix + (cap,), fill, dtype=dtype)
            )
            if arr is not None and old:
                new[..., :old] = arr
            return new

        first = old == 0
        # Sums and sample counts of every binned row in one array (sums first): one scatter per
        # flush and one gather per read serve both.
        self.acc = grow(None if first else self.acc, 0.0, (2 * N_BINNED, self.ring))
        self.bin_id = grow(None if first else self.bin_id, -1, (self.ring,), np.int64)
        self.slot_job = grow(None if first else self.slot_job, NO_JOB, (), np.int64)
        self.slot_job_since = grow(None if first else self.slot_job_since, np.nan)
        self.slot_last_job = grow(None if first else self.slot_last_job, NO_JOB, (), np.int64)
        self.slot_last_time = grow(None if first else self.slot_last_time, -np.inf)
        self.slot_node_id = grow(None if first else self.slot_node_id, -1, (), np.int64)
        self.slot_model_id = grow(None if first else self.slot_model_id, -1, (), np.int64)
        self._counter_val = grow(None if first else self._counter_val, np.nan, (len(_COUNTER_COLS),))
        self._counter_time = grow(None if first else self._counter_time, -np.inf, (len(_COUNTER_COLS),))
        self.slot_limits = grow(None if first else self.slot_limits, np.nan, (len(LIMIT_COLS),))
        self._cap = cap

    def reserve(self, n_slots: int) -> None:
        """Size the per-GPU arrays for n_slots GPUs at once: registering GPUs one by one copies the rings
        at every doubling (about 60 ms of a 2.2 s replay of 2,048 GPUs)."""
        self._grow(n_slots)

    def _new_slot(self, node: str, index: int, uuid: str, model: str) -> int:
        """Register a GPU; slots are never reused so history stays attached to its GPU."""
        slot = self.n
        self._grow(slot + 1)
        self.n += 1
        self.slot_of[(node, index)] = slot
        self.slot_node.append(node)
        self.slot_index.append(index)
        self.slot_uuid.append(uuid)
        self.slot_model.append(model)
        node_id = self.node_ids.get(node)
        if node_id is None:
            node_id = self.node_ids[node] = len(self.node_names)
            self.node_names.append(node)
            self.node_last_time = np.append(self.node_last_time, np.nan)
        self.slot_node_id[slot] = node_id
        self.slot_model_id[slot] = self.model_ids.setdefault(model, len(self.model_ids))
        return slot

    def job_code(self, job: str | None) -> int:
        """Small integer for a job name (NO_JOB for None)."""
        if job is None:
            return NO_JOB
        code = self.job_codes.get(job)
        if code is None:
            code = self.job_codes[job] = len(self.job_names)
            self.job_names.append(job)
        return code

    def _resolve(self, sample: NodeSample) -> tuple[np.ndarray, np.ndarray]:
        """Slots and job codes for a snapshot's rows, cached per node."""
        cache = self._nodes.get(sample.node)
        if cache is None:
            cache = self._nodes[sample.node] = _NodeCache()
        elif sample.indices is cache.indices and sample.uuids is cache.uuids and sample.jobs is cache.jobs:
            return cache.slots, cache.job_codes  # the parser shares a node's identity tuples between lines
        if sample.indices != cache.indices or sample.uuids != cache.uuids:
            slots = []
            for index, uuid, model in zip(sample.indices, sample.uuids, sample.models):
                slot = self.slot_of.get((sample.node, index))
                if slot is None:
                    slot = self._new_slot(sample.node, index, uuid, model)
                else:
                    self.slot_uuid[slot] = uuid
                slots.append(slot)
            cache.indices, cache.uuids = sample.indices, sample.uuids
            cache.slots = np.array(slots, dtype=np.int64)
            cache.jobs = ()
        if sample.jobs != cache.jobs:
            cache.jobs = sample.jobs
            cache.job_codes = np.array([self.job_code(j) for j in sample.jobs], dtype=np.int64)
        return cache.slots, cache.job_codes

    def forget_node(self, node: str) -> np.ndarray:
        """A node that went away: its GPUs' slots keep their place (a node that returns takes them back,
        so state does not grow with every departure), but nothing of what they held: bins, jobs, counters,
        limits, times, cached identity and pending events. Returns the slots."""
        nid = self.node_ids.get(node)
        if nid is None:
            return np.empty(0, dtype=np.int64)
        slots = np.flatnonzero(self.slot_node_id[: self.n] == nid)
        self.bin_id[:, slots] = -1
        self.slot_job[slots] = NO_JOB
        self.slot_job_since[slots] = np.nan
        self.slot_last_job[slots] = NO_JOB
        self.slot_last_time[slots] = -np.inf
        self._counter_val[:, slots] = np.nan
        self._counter_time[:, slots] = -np.inf
        self.slot_limits[:, slots] = np.nan
        self.node_last_time[nid] = np.nan
        self._nodes.pop(node, None)
        gone = set(slots.tolist())
        for slot in gone:
            self._xid_maps.pop(slot, None)
        self.events = [e for e in self.events if e.slot not in gone]
        return slots

    # -- ingest -------------------------------------------------------------------------------
    def add(self, sample: NodeSample) -> None:
        """Queue a sample; it reaches the rings at the next flush."""
        self._inbox.append(sample)

    def pending(self) -> int:
        """Samples queued since the last flush."""
        return len(self._inbox)

    def flush(self, min_bin: int) -> None:
        """Move queued samples into the rings; bins older than min_bin are gone and dropped."""
        if not self._inbox:
            return
        if self._prepared is not None:
            inbox, self._inbox = self._inbox, []
            self._prepared.flush(inbox, min_bin)
            return
        inbox = sorted(self._recent(self._inbox, min_bin), key=_TIME_NODE)
        self._inbox = []
        if not inbox:
            return
        resolved = list(map(self._resolve, inbox))
        slot_lists = [r[0] for r in resolved]
        counts = list(map(len, slot_lists))
        if 0 in counts:  # drop snapshots that list no GPU
            pairs = [(smp, r) for smp, r in zip(inbox, resolved) if len(r[0])]
            if not pairs:
                return
            inbox, resolved = map(list, zip(*pairs))
            slot_lists = [r[0] for r in resolved]
            counts = list(map(len, slot_lists))
        sample_times = [smp.time for smp in inbox]
        node_ids = [self.node_ids[smp.node] for smp in inbox]
        slots = np.concatenate(slot_lists)
        codes = np.concatenate([r[1] for r in resolved])
        values = np.concatenate([smp.values for smp in inbox])
        times = np.repeat(sample_times, counts)
        self.samples += len(slots)
        self.newest_time = max(self.newest_time, sample_times[-1])
        self.resumed_time = sample_times[0]
        # The inbox is in time order, so a node's last write carries its newest time (fmax skips NaN).
        self.node_last_time[node_ids] = np.fmax(self.node_last_time[node_ids], sample_times)
        in_order = times >= self.slot_last_time[slots]
        by_slot = np.argsort(slots, kind="stable")  # per slot, still in time order
        self._update_jobs(slots, codes, times, in_order, by_slot)
        self.note_limits(slots, values[:, LIMIT_COLS])
        sorted_slots = slots[by_slot]
        one_per_slot = not (sorted_slots[1:] == sorted_slots[:-1]).any()
        power_from_energy = self._counters(slots, times, values, in_order, inbox, by_slot, one_per_slot)
        self._bin(slots, times, self._derive(values, power_from_energy), min_bin, one_per_slot)

    def _recent(self, inbox: list[NodeSample], min_bin: int) -> list[NodeSample]:
        """The snapshots a window can still use; the rest are counted in too_old_dropped.

        A snapshot is too old when its bin is gone (before min_bin) or it trails its node's newest sample
        by more than the window: a buffer from before an outage, a clock that stood still. Taken, it would
        set its node's times, counters and jobs back and, from a fresh engine, start the evaluation there."""
        oldest = min_bin * self.tick
        span = self.ring * self.tick
        newest: dict[str, float] = {}
        for smp in inbox:
            if smp.time > newest.get(smp.node, -np.inf):
                newest[smp.node] = smp.time
        for node, t in newest.items():
            nid = self.node_ids.get(node)
            if nid is not None and self.node_last_time[nid] > t:
                newest[node] = float(self.node_last_time[nid])
        kept = [smp for smp in inbox if smp.time >= oldest and smp.time >= newest[smp.node] - span]
        self.too_old_dropped += len(inbox) - len(kept)
        return kept

    def note_limits(self, slots: np.ndarray, limits: np.ndarray) -> None:
        """Keep each GPU's newest reported limits (rows in time order: the last write wins); a limit
        not reported leaves the one known before."""
        known = ~np.isnan(limits)
        if known.all():
            self.slot_limits[:, slots] = limits.T
        else:
            r, c = np.nonzero(known)  # row-major: a GPU's newer rows come later
            self.slot_limits[c, slots[r]] = limits[r, c]

    def _update_jobs(
        self,
        slots: np.ndarray,
        codes: np.ndarray,
        times: np.ndarray,
        in_order: np.ndarray,
        by_slot: np.ndarray | None = None,
    ) -> None:
        """Current job of each GPU follows its newest sample; a change restarts its job clock (by_slot:
        rows ordered by slot, then time; computed here when None and needed)."""
        if in_order.all() and (codes == self.slot_job[slots]).all():
            # No GPU changed job (the usual case): only the sample times move. Rows are in time
            # order, so each GPU's newest time is written last.
            self.slot_last_time[slots] = times
            return
        if by_slot is None:
            by_slot = np.argsort(slots, kind="stable")
        order = by_slot[in_order[by_slot]]  # in-order rows, per slot in time order
        s, c, t = slots[order], codes[order], times[order]
        prev = np.empty_like(c)
        prev[1:] = c[:-1]
        first = np.ones(len(s), dtype=bool)
        first[1:] = s[1:] != s[:-1]
        prev[first] = self.slot_job[s[first]]
        changed = c != prev
        if changed.any():
            # Assignment keeps the last write per slot: the latest change wins.
            self.slot_job_since[s[changed]] = t[changed]
        self.slot_job[s] = c
        attributed = c != NO_JOB
        self.slot_last_job[s[attributed]] = c[attributed]
        self.slot_last_time[s] = t

    def _counters(
        self,
        slots: np.ndarray,
        times: np.ndarray,
        values: np.ndarray,
        in_order: np.ndarray,
        inbox: list,
        order: np.ndarray,
        one_per_slot: bool = False,
    ) -> np.ndarray:
        """Difference the energy and health counters per GPU (rows taken in `order`: by slot, then time); returns
        average power from energy per row (NaN where there is no previous reading, time did not advance,
        or the counter was reset)."""
        s, t = slots[order], times[order]
        power = np.full(len(slots), np.nan)
        counters = values[order[:, None], _COUNTER_COLS]
        known = ~np.isnan(counters) & in_order[order][:, None]
        for i in (0,) + self._health_counters_moved(counters, known, s, t):
            v = counters[:, i]
            ok = known[:, i]
            if not ok.any():
                continue
            if i and np.array_equal(v[ok], self._counter_val[i, s[ok]]):
                self._counter_time[i, s[ok]] = t[ok]
                continue  # no counter moved: nothing to difference
            delta, dt, reset = self._diff(i, s[ok], t[ok], v[ok], one_per_slot)
            if i == 0:
                # Energy across a reset has no known rate; everything else counts from zero.
                rate = np.where((dt > 0) & ~reset, delta / np.where(dt > 0, dt, 1.0), np.nan)
                power[order[ok]] = rate
            else:
                self._record_events(i, order[ok], s[ok], t[ok], delta, values, inbox)
        return power

    def _health_counters_moved(
        self, counters: np.ndarray, known: np.ndarray, s: np.ndarray, t: np.ndarray
    ) -> tuple[int, ...]:
        """Columns of the health counters to difference: none when no reading differs from its GPU's
        last one (the usual case; then only their reading times advance), else all."""
        r, c = np.nonzero(known[:, 1:])
        c += 1
        if len(r) and not (counters[r, c] == self._counter_val[c, s[r]]).all():
            return _HEALTH_COUNTERS
        # Row-major order: per GPU and counter the newest reading is written last.
        self._counter_time[c, s[r]] = t[r]
        return ()

    def _diff(
        self, i: int, s: np.ndarray, t: np.ndarray, v: np.ndarray, one_per_slot: bool = False
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-row increase and elapsed time against the same GPU's previous reading (rows by slot, then
        time; one_per_slot: no GPU appears twice, so every previous reading is the stored one)."""
        if one_per_slot:
            prev_v, prev_t = self._counter_val[i, s], self._counter_time[i, s]
            self._counter_val[i, s], self._counter_time[i, s] = v, t
        else:
            prev_v, prev_t = self._previous(i, s, t, v)
        # A counter that went backwards was reset (driver reload, agent restart, wrap): count from 0.
        reset = v < prev_v
        delta = np.where(np.isnan(prev_v), 0.0, np.where(reset, v, v - prev_v))
        dt = np.where(np.isfinite(prev_t), t - prev_t, np.nan)
        return delta, dt, reset

    def _previous(self, i: int, s: np.ndarray, t: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each row's previous reading of counter i (the row before it of the same GPU, else the stored
        one); stores each GPU's last row."""
        prev_v = np.empty_like(v)
        prev_t = np.empty_like(t)
        first = np.ones(len(s), dtype=bool)
        first[1:] = s[1:] != s[:-1]
        prev_v[1:], prev_t[1:] = v[:-1], t[:-1]
        prev_v[first] = self._counter_val[i, s[first]]
        prev_t[first] = self._counter_time[i, s[first]]
        last = np.ones(len(s), dtype=bool)
        last[:-1] = s[:-1] != s[1:]
        self._counter_val[i, s[last]] = v[last]
        self._counter_time[i, s[last]] = t[last]
        return prev_v, prev_t

    def _record_events(
        self, i: int, rows: np.ndarray, s: np.ndarray, t: np.ndarray, delta: np.ndarray, values: np.ndarray, inbox: list
    ) -> None:
        """Turn a health counter's increases into events (rare; plain Python is fine)."""
        hit = np.flatnonzero(delta > 0)
        if not len(hit):
            return
        xid = i == _XID_COUNTER
        row_xids = _row_xid_maps(inbox) if xid else None
        for h in hit:
            slot, row = int(s[h]), int(rows[h])
            codes: tuple[int, ...] = ()
            if xid:
                codes = self._xid_codes(slot, row_xids[row] if row_xids else None, values[row, LAST_XID])
            self.events.append(CounterEvent(slot, float(t[h]), _EVENT_KINDS[i], int(delta[h]), codes))

    def _xid_codes(self, slot: int, by_code: dict[int, int] | None, last_xid: float) -> tuple[int, ...]:
        """Which XID codes increased: from the per-code map when present, else the last XID."""
        if by_code:
            before = self._xid_maps.get(slot, {})
            self._xid_maps[slot] = dict(by_code)
            grown = tuple(sorted(c for c, n in by_code.items() if n > before.get(c, 0)))
            if grown:
                return grown
        return () if np.isnan(last_xid) else (int(last_xid),)

    def _derive(self, values: np.ndarray, power_from_energy: np.ndarray) -> np.ndarray:
        """Rows of binned quantities: direct readings, clock ratio and throttle-bit indicators."""
        out = np.empty((N_BINNED, len(values)))
        out[:_N_DIRECT] = values[:, _DIRECT_COLS].T
        # Average power over the sampling interval (from the energy counter) beats the instantaneous
        # reading: a synchronous job's GPUs all sit in the same step phase at a sample instant, so
        # instantaneous power aliases with the step cycle at 5-10 s sampling.
        out[B_POWER] = np.where(np.isnan(power_from_energy), out[B_POWER], power_from_energy)
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = values[:, CLOCK] / values[:, CLOCK_MAX]
        out[B_CLOCK_RATIO] = np.where(values[:, CLOCK_MAX] > 0, ratio, np.nan)
        throttle = values[:, THROTTLE]
        known = ~np.isnan(throttle)
        # The bits tested are the low ones; NVML's "unknown" reason is bit 63, beyond int64 (and beyond a
        # float's 53-bit mantissa, which has already lost the low bits of such a value).
        bits = np.fmod(np.where(known, throttle, 0.0), 2.0**32).astype(np.int64)
        out[_BIT_ROWS] = np.where(known, (bits & _BIT_MASKS) != 0, np.nan)
        return out

    def _bin(
        self, slots: np.ndarray, times: np.ndarray, derived: np.ndarray, min_bin: int, one_per_slot: bool = False
    ) -> None:
        """Accumulate rows into their (bin, GPU) cells, resetting cells that held an older bin
        (one_per_slot: no GPU appears twice in the batch, so no two rows share a cell)."""
        bins = np.floor(times / self.tick).astype(np.int64)
        pos = bins % self.ring
        held = self.bin_id[pos, slots]
        keep = (bins >= min_bin) & (bins >= held)
        if not keep.all():
            self.late_dropped += int(np.count_nonzero(~keep))
            slots, bins, pos, held, derived = slots[keep], bins[keep], pos[keep], held[keep], derived[:, keep]
        # Cells are addressed as columns of self.cells(), pos * cap + slot: numpy's 3-d fancy assignment
        # costs several times more per tick than scattering columns.
        cells = self.cells()
        cell = pos * self._cap + slots
        # A cell that held an older bin starts from zero (it is overwritten below, not cleared first).
        fresh = bins > held
        if fresh.any():
            self.bin_id[pos[fresh], slots[fresh]] = bins[fresh]
        valid = ~np.isnan(derived)
        add = np.concatenate([np.where(valid, derived, 0.0), valid])  # sums, then counts
        if one_per_slot:
            # Every cell once (the usual case at tick-rate sampling): scatter straight away.
            if fresh.all():
                # Every cell starts from zero (the usual case): 0.0 + row is row + 0.0, no gather needed.
                scatter_cells(cells, cell, add + 0.0)
                return
            scatter_cells(cells, cell, np.where(fresh, 0.0, cells[:, cell]) + add)
            return
        order = np.argsort(cell, kind="stable")
        sorted_cell = cell[order]
        first = np.ones(len(cell), dtype=bool)
        first[1:] = sorted_cell[1:] != sorted_cell[:-1]
        if not first.all():
            # Several samples of one GPU in one bin (sub-tick sampling): sum them before scattering,
            # every row in one bincount (a few times cheaper than reduceat over many short runs).
            starts = np.flatnonzero(first)
            n_cells = len(starts)
            cell_of_row = np.empty(len(cell), dtype=np.int64)
            cell_of_row[order] = np.cumsum(first) - 1
            ids = (cell_of_row + np.arange(len(add))[:, None] * n_cells).ravel()
            add = np.bincount(ids, weights=add.ravel(), minlength=len(add) * n_cells).reshape(len(add), n_cells)
            order = order[starts]
        else:
            add = add[:, order]
        # One entry per cell now, so gather-add-scatter is exact (and cheaper than fancy +=).
        at = cell[order]
        scatter_cells(cells, at, np.where(fresh[order], 0.0, cells[:, at]) + add)

    def cells(self) -> np.ndarray:
        """self.acc as (row, cell) with cell = bin position * capacity + slot: a view, for scattering the
        cells of many bins and slots at once."""
        return self.acc.reshape(len(self.acc), -1)

    # -- replay ---------------------------------------------------------------------------------
    def prepare(self, prepared: PreparedFlushes) -> None:
        """Replay's promise: the samples `prepared` holds will be add()ed in its order, each flush taking
        the next ones (server.engine.prepared.prepare_windows makes the promise)."""
        self._prepared = prepared

    # -- reading ------------------------------------------------------------------------------
    def window(self, last_bin: int, n_bins: int) -> np.ndarray:
        """Bin means, shape (N_BINNED, n_bins, n) newest first; NaN where no sample or unsupported."""
        return self.recent(last_bin, n_bins, np.arange(N_BINNED)).transpose(1, 0, 2)

    def latest(self, last_bin: int, held: np.ndarray) -> np.ndarray:
        """Bin means of every binned row in one bin, shape (N_BINNED, n); `held` is self.held(last_bin, 1)[0]."""
        pos, n = last_bin % self.ring, self.n
        acc = self.acc[:, pos, :n]
        with np.errstate(invalid="ignore", divide="ignore"):
            means = acc[:N_BINNED] / acc[N_BINNED:]
        return means * np.where(held, 1.0, np.nan)

    def held(self, last_bin: int, n_bins: int) -> np.ndarray:
        """Shape (n_bins, n), newest first: whether each slot has a sample in bin last_bin - i."""
        ks = last_bin - np.arange(n_bins)
        return self.bin_id[ks % self.ring, : self.n] == ks[:, None]

    def recent(
        self,
        last_bin: int,
        n_bins: int,
        rows: np.ndarray | list[int],
        held: np.ndarray | None = None,
        slots: np.ndarray | None = None,
    ) -> np.ndarray:
        """Bin means of some binned rows, shape (n_bins, len(rows), n) newest first; NaN where no sample
        or unsupported. `held` is self.held(last_bin, n_bins) when the caller has it already. With
        `slots`, only those GPUs' columns (shape (n_bins, len(rows), len(slots))): a finding's evidence
        reads a few GPUs, and gathering every GPU's bins for it cost more than the tick's own read."""
        if held is None:
            held = self.held(last_bin, n_bins)
        n = self.n
        pos = ((last_bin - np.arange(n_bins)) % self.ring)[:, None]
        rows = np.asarray(rows)
        both = np.concatenate([rows, rows + N_BINNED])[None, :]  # sums, then counts
        if slots is None:
            acc = self.acc[both, pos, :n]
        else:
            slots = np.asarray(slots)
            if slots.dtype == bool:
                slots = np.flatnonzero(slots)
            acc = self.acc[both[:, :, None], pos[:, :, None], slots[None, None, :]]
            held = held[:, slots]
        # 0/0 (no sample) is NaN already; a stale cell (an older bin at that position) is masked by
        # multiplying with NaN, and x * 1.0 keeps every other mean exactly.
        with np.errstate(invalid="ignore", divide="ignore"):
            means = acc[:, : len(rows)] / acc[:, len(rows) :]
        return means * np.where(held, 1.0, np.nan)[:, None, :]

    def has_data(self, last_bin: int, n_bins: int) -> np.ndarray:
        """Per slot: whether any sample fell into the last n_bins bins."""
        return np.asarray(self.held(last_bin, n_bins).any(axis=0))

    def drain_events(self) -> list[CounterEvent]:
        """Counter events since the last call."""
        events, self.events = self.events, []
        return events


# Up to this many runs of consecutive cells are copied run by run; past it, cell by cell.
_MAX_RUNS = 16


def scatter_cells(cells: np.ndarray, cell: np.ndarray, values: np.ndarray) -> None:
    """cells[:, cell] = values, where no cell appears twice. Cells in increasing order that form a few runs
    of consecutive cells (a bin's GPUs in slot order, some missing: the usual case) are copied a run at
    a time: numpy copies a slice's rows whole, and an index array's cells one by one, some ten times
    slower for a tick's cells."""
    n = len(cell)
    if n > 1:
        step = cell[1:] - cell[:-1]
        if (step > 0).all():
            breaks = np.flatnonzero(step != 1) + 1
            if len(breaks) < _MAX_RUNS:
                bounds = [0, *breaks.tolist(), n]
                for a, b, first in zip(bounds, bounds[1:], cell[bounds[:-1]].tolist()):
                    cells[:, first : first + b - a] = values[:, a:b]
                return
    cells[:, cell] = values


def _row_xid_maps(inbox: list[NodeSample]) -> list:
    """Per-row XID-by-code maps across the flushed batch (None where absent)."""
    out: list = []
    for s in inbox:
        out.extend(s.xid_by_code if s.xid_by_code is not None else (None,) * len(s))
    return out
