"""Peer groups and their history: which GPUs are compared with which, and each group's own baseline.

A GPU's peers are the GPUs of its hpc_job. Without attribution, GPUs whose readings move together are
one inferred job (see engine.inference): compared as a job, GPU by GPU and node by node. The rest fall
back to the busy GPUs of the same model on the same node (GPU-level comparisons) and, for whole-node
comparisons, all unattributed GPUs of the same model across nodes; those groups may mix jobs. Group ids
are interned so a group's history survives across ticks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from gpufleet.server.engine.arrays import grown
from gpufleet.server.engine.reduce import equal
from gpufleet.server.engine.windows import NO_JOB

JOB = "hpc_job"
# The smoothed per-GPU readings that are compared with peers, as rows of one array (see Tick.levels).
LEVELS = ("sm", "power", "clock", "util")
NODE_MODEL = "node_model"
CLUSTER_MODEL = "cluster_model"
INFERRED_JOB = "inferred_job"
# Group kinds that hold one job: named by attribution, or inferred from co-movement.
_ONE_JOB = (JOB, INFERRED_JOB)


def group_median(values: np.ndarray, gid: np.ndarray, n_groups: int) -> np.ndarray:
    """NaN-aware median of values per group id (ids < 0 ignored); NaN for empty groups."""
    return group_medians(values[None, :], gid, n_groups)[0]


def group_medians(values: np.ndarray, gid: np.ndarray, n_groups: int) -> np.ndarray:
    """group_median of every row of a (k, n) array at once, shape (k, n_groups).

    Row r's group g becomes the combined id r * n_groups + g, so one sort serves all rows: a tick
    needs a dozen grouped medians over a few hundred GPUs, where numpy's per-call cost dominates.
    """
    k = values.shape[0]
    ok = (gid >= 0) & ~np.isnan(values)
    ids = (gid + np.arange(k)[:, None] * n_groups)[ok]
    x = values[ok]
    out = np.full(k * n_groups, np.nan)
    if len(ids):
        xs = x[group_order(x, ids, k * n_groups)]
        counts = np.bincount(ids, minlength=k * n_groups)
        starts = np.cumsum(counts) - counts
        has = counts > 0
        lo = (starts + (counts - 1) // 2)[has]
        hi = (starts + counts // 2)[has]
        out[has] = (xs[lo] + xs[hi]) / 2.0
    return out.reshape(k, n_groups)


def group_order(x: np.ndarray, ids: np.ndarray, n_ids: int) -> np.ndarray:
    """Order that makes ids contiguous and ascending, x ascending within each id.

    Same result as np.lexsort((x, ids)) up to the order of equal x, at half the cost: sort x, then
    a stable sort by id, which numpy does as a radix sort when the ids fit 16 bits.
    """
    order = np.argsort(x)
    keys = ids[order]
    if n_ids <= np.iinfo(np.int16).max:
        keys = keys.astype(np.int16)
    return order[np.argsort(keys, kind="stable")]


class GroupLayout:
    """A fixed membership (ids per member, < 0: none) laid out as a padded (group, member) table, for
    grouped medians that are repeated while membership stays the same (it usually does for many ticks).

    Sorting each table row costs a fraction of group_medians' two sorts over all values; membership
    so lopsided that padding would dominate falls back to group_medians.
    """

    def __init__(self, ids: np.ndarray, n_groups: int, where: np.ndarray | None = None) -> None:
        self.ids = ids.copy()
        self.n_groups = n_groups
        # Member j's values sit in column where[j] of the arrays passed to medians() (default: j).
        self.where = np.arange(len(ids)) if where is None else where.copy()
        members = np.flatnonzero(ids >= 0)
        order = members[np.argsort(ids[members], kind="stable")]
        counts = np.bincount(ids[members], minlength=n_groups)
        width = int(counts.max()) if len(members) else 0
        self.padded = width * n_groups <= 4 * len(members) + 64
        if self.padded:
            # Padding points at column -1, where medians() puts a NaN.
            self.table = np.full((n_groups, width), -1, dtype=np.intp)
            column = np.arange(len(order)) - np.repeat(np.cumsum(counts) - counts, counts)
            self.table[ids[order], column] = self.where[order]
            self._scratch = np.empty((0, 0))  # values plus a NaN column, reused across ticks
            self._first = np.empty(0, dtype=np.intp)  # where each (reading, group) row starts, flat

    def medians(self, values: np.ndarray) -> np.ndarray:
        """group_medians(values[:, where], ids, n_groups) for a (k, n) array, shape (k, n_groups)."""
        if not self.padded:
            return group_medians(values[:, self.where], self.ids, self.n_groups)
        k, n = values.shape
        G, width = self.table.shape
        if width == 0:
            return np.full((k, G), np.nan)
        if self._scratch.shape != (k, n + 1):
            self._scratch = np.full((k, n + 1), np.nan)
            self._first = np.arange(k * G) * width
        self._scratch[:, :n] = values
        # take: the same gather as [:, table] at half its cost where k > 1.
        rows = np.sort(np.take(self._scratch, self.table, axis=1), axis=2)  # NaN last in each row
        cnt = width - np.isnan(rows).sum(axis=2).ravel()
        # cnt // 2 < width always; an empty group's middle is padding, i.e. NaN.
        flat = rows.ravel()
        lo = flat[self._first + np.maximum(cnt - 1, 0) // 2]
        hi = flat[self._first + cnt // 2]
        return ((lo + hi) / 2.0).reshape(k, G)


def group_mean(values: np.ndarray, gid: np.ndarray, n_groups: int) -> np.ndarray:
    """NaN-aware mean per group id; NaN for empty groups."""
    return group_means(values[None, :], gid, n_groups)[0]


def group_means(values: np.ndarray, gid: np.ndarray, n_groups: int) -> np.ndarray:
    """group_mean of every row of a (k, n) array at once, shape (k, n_groups)."""
    k = values.shape[0]
    ok = (gid >= 0) & ~np.isnan(values)
    ids = (gid + np.arange(k)[:, None] * n_groups)[ok]
    counts = np.bincount(ids, minlength=k * n_groups)
    sums = np.bincount(ids, weights=values[ok], minlength=k * n_groups)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan).reshape(k, n_groups)


@dataclass(slots=True)
class Groups:
    """One tick's grouping: GPU-level group id and node-level group id per slot, plus group stats."""

    gid: np.ndarray  # per slot, GPU-level peer group (-1: none)
    ngid: np.ndarray  # per slot, node-level group (-1: none)
    n_groups: int
    size: np.ndarray  # per group, members with data
    levels: np.ndarray  # (4, n_groups) medians of the smoothed per-GPU LEVELS, rows as named below
    slow: np.ndarray  # per group means of the smoothed throttle-bit shares
    power_cap: np.ndarray
    members: "GroupMembers | None" = None  # what the statistics were taken over (reused next tick)

    @property
    def sm(self) -> np.ndarray:
        """Median SM activity per group."""
        return self.levels[0]

    @property
    def power(self) -> np.ndarray:
        """Median power per group."""
        return self.levels[1]

    @property
    def clock(self) -> np.ndarray:
        """Median SM clock ratio per group."""
        return self.levels[2]

    @property
    def util(self) -> np.ndarray:
        """Median utilization per group."""
        return self.levels[3]


class GroupRegistry:
    """Interns group keys to ids and remembers when each group was first seen.

    Every job ever seen is a group, and every per-group array in the engine is as long as the number of
    ids: on a cluster running thousands of jobs a day, a server up for weeks would grow without bound and
    slow down tick by tick. So the id of a group without members for `retention_seconds` is given to the
    next new group (listed in `recycled` with the key it had), and the engine forgets what it knew
    under that id. A group that comes back before its id is taken keeps its history.
    """

    def __init__(self, retention_seconds: float = math.inf) -> None:
        self.retention_seconds = retention_seconds
        self.ids: dict[tuple, int] = {}
        self.keys: list[tuple] = []
        self.first_seen = np.full(0, np.nan)
        self.is_job = np.zeros(0, dtype=bool)
        # One job, attributed or inferred: compared as a job (is_job: attributed only, named by it).
        self.one_job = np.zeros(0, dtype=bool)
        self.dated = np.zeros(0, dtype=bool)  # dated back: running before it was first seen
        # Unattributed node groups restarted by the last build() (see _build), and each one's members.
        self.restarted: list[int] = []
        # Ids given to new groups by the last build(), each with the key it had before.
        self.recycled: list[tuple[int, tuple]] = []
        # New inferred jobs of the last build() that absorbed whole groups: (new id, the absorbed group
        # whose history it takes over), and per slot whether what its GPU learned carries over.
        self.absorbed: list[tuple[int, int]] = []
        self.carried = np.zeros(0, dtype=bool)
        self._busy_sets: dict[int, tuple[int, ...]] = {}
        self._last_gid = np.full(0, -1, dtype=np.int64)  # per slot, the GPU-level group of the last _build
        self._last_build: tuple | None = None
        self._present: set[int] = set()
        self._vacated: dict[int, float] = {}  # group without members -> since when (insertion order)

    def intern(self, key: tuple, t: float) -> int:
        """Id for a group key, registering it (first seen at t) when new."""
        gid = self.ids.get(key)
        if gid is None:
            gid = self._retired(t)
            if gid is None:
                gid = len(self.keys)
                self.keys.append(key)
                self.first_seen = np.append(self.first_seen, t)
                self.is_job = np.append(self.is_job, key[0] == JOB)
                self.one_job = np.append(self.one_job, key[0] in _ONE_JOB)
                self.dated = np.append(self.dated, False)
            else:
                old = self.keys[gid]
                del self.ids[old]
                self.recycled.append((gid, old))
                self.keys[gid] = key
                self.first_seen[gid] = t
                self.is_job[gid] = key[0] == JOB
                self.one_job[gid] = key[0] in _ONE_JOB
                self.dated[gid] = False
                self._busy_sets.pop(gid, None)
            self.ids[key] = gid
        return gid

    def _retired(self, t: float) -> int | None:
        """The id vacated longest ago, if that was retention_seconds before t (and take it off the list)."""
        oldest = next(iter(self._vacated.items()), None)
        if oldest is None or t - oldest[1] < self.retention_seconds:
            return None
        del self._vacated[oldest[0]]
        return oldest[0]

    def backdate(self, gids: np.ndarray, seconds: float) -> None:
        """Take these groups as first seen `seconds` earlier (work that was running before anyone watched)."""
        self.first_seen[gids] -= seconds
        self.dated[gids] = True

    def job(self, gid: int) -> str | None:
        """The hpc_job of a job group, None for fallback groups."""
        key = self.keys[gid]
        return key[1] if key[0] == JOB else None

    def kind(self, gid: int) -> str:
        """JOB, INFERRED_JOB, NODE_MODEL or CLUSTER_MODEL."""
        return self.keys[gid][0]

    def inferred(self, gid: int) -> bool:
        """Whether the group's peers were inferred (no hpc_job attribution)."""
        return self.keys[gid][0] != JOB

    def fallback_groups(self, model_id: int) -> set[int]:
        """Every unattributed group of one GPU model: the per-node ones and the cluster-wide one."""
        return {gid for key, gid in self.ids.items() if key[0] != JOB and key[-1] == model_id}

    def build(
        self,
        t: float,
        slot_job: np.ndarray,
        slot_node: np.ndarray,
        slot_model: np.ndarray,
        job_names: list[str],
        has_data: np.ndarray,
        busy: np.ndarray,
        engaged: np.ndarray | None = None,
        inferred: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Per-slot GPU-level and node-level group ids for this tick (read-only arrays). `engaged`: the
        unattributed GPUs that count in node-level comparisons (default: all); `inferred`: per slot, the
        label of its inferred job (engine.inference; < 0 or default: none)."""
        if engaged is None:
            engaged = np.ones(len(slot_job), dtype=bool)
        if inferred is None:
            inferred = np.full(len(slot_job), -1, dtype=np.int64)
        # Busy-ness matters only for unattributed GPUs (their fallback groups are the busy ones): an
        # attributed GPU crossing the busy threshold must not force a rebuild.
        loose = slot_job == NO_JOB
        inputs = (
            slot_job,
            slot_node,
            slot_model,
            has_data,
            busy & loose,
            engaged & loose,
            np.where(loose, inferred, -1),
        )
        last = self._last_build
        # Membership rarely changes between ticks; the same inputs give the same (already interned) ids.
        if last is not None and all(equal(a, b) for a, b in zip(inputs, last[0])):
            self.restarted = []
            self.recycled = []
            self.absorbed = []
            self.carried = np.zeros(len(slot_job), dtype=bool)
            return last[1]
        self.recycled = []
        self.absorbed = []
        self.carried = np.zeros(len(slot_job), dtype=bool)
        gid, ngid = self._build(t, slot_job, slot_node, slot_model, job_names, has_data, busy, engaged, inferred)
        self._note_presence(t, gid, ngid)
        gid.flags.writeable = ngid.flags.writeable = False
        self._last_build = (tuple(a.copy() for a in inputs), (gid, ngid))
        return gid, ngid

    def _note_presence(self, t: float, gid: np.ndarray, ngid: np.ndarray) -> None:
        """Date the groups that lost their last member (membership only changes in _build)."""
        present = set(np.unique(np.concatenate([gid[gid >= 0], ngid[ngid >= 0]])).tolist())
        for g in self._present - present:
            self._vacated[g] = t
        for g in present - self._present:
            self._vacated.pop(g, None)
        self._present = present

    def _build(
        self,
        t: float,
        slot_job: np.ndarray,
        slot_node: np.ndarray,
        slot_model: np.ndarray,
        job_names: list[str],
        has_data: np.ndarray,
        busy: np.ndarray,
        engaged: np.ndarray,
        inferred: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """build() without the reuse."""
        n = len(slot_job)
        gid = np.full(n, -1, dtype=np.int64)
        ngid = np.full(n, -1, dtype=np.int64)
        attributed = (slot_job >= 0) & has_data
        if attributed.any():
            codes = np.unique(slot_job[attributed])
            table = np.full(int(codes.max()) + 1, -1, dtype=np.int64)
            for c in codes:
                table[c] = self.intern((JOB, job_names[c]), t)
            gid[attributed] = table[slot_job[attributed]]
            ngid[attributed] = gid[attributed]
        loose = (slot_job == NO_JOB) & has_data
        busy_sets: dict[int, tuple[int, ...]] = {}
        self.restarted = []
        if loose.any():
            joined = loose & (inferred >= 0)
            self._place_inferred(t, inferred, joined, slot_model, gid, ngid)
            loose &= ~joined
            for node, model in set(zip(slot_node[loose & busy].tolist(), slot_model[loose & busy].tolist())):
                sel = loose & busy & (slot_node == node) & (slot_model == model)
                g = self.intern((NODE_MODEL, node, model), t)
                gid[sel] = g
                # Without attribution the busy set is the only hint of what runs together: a GPU
                # joining or leaving it (or the set coming back after it emptied) is a job starting or
                # ending there. The group restarts (start-up grace, baseline, learned offsets) instead
                # of judging the new work by a baseline that describes the old. Same id: the number
                # of groups stays bounded however often the set changes.
                members = busy_sets[g] = tuple(np.flatnonzero(sel).tolist())
                # (A group first seen now has nothing to forget.)
                if self._busy_sets.get(g) != members and self.first_seen[g] < t:
                    self.first_seen[g] = t
                    self.dated[g] = False
                    self.restarted.append(g)
            # A GPU idle for long is in no job: counted, it would drag its node's median towards idle
            # (a job on half of every node reads as half idle everywhere).
            for model in set(slot_model[loose & engaged].tolist()):
                sel = loose & engaged & (slot_model == model)
                ngid[sel] = self.intern((CLUSTER_MODEL, model), t)
        self._busy_sets = busy_sets
        self._last_gid = gid
        return gid, ngid

    def _place_inferred(
        self,
        t: float,
        inferred: np.ndarray,
        joined: np.ndarray,
        slot_model: np.ndarray,
        gid: np.ndarray,
        ngid: np.ndarray,
    ) -> None:
        """Give the GPUs of each inferred job its group, GPU- and node-level alike, as a job's. A new
        inferred job was running already: its GPUs' previous groups saw it start, so it is taken as first
        seen when the earliest of them was (and dated back if one was).

        A previous group all of whose GPUs went into one inferred job was a part of that job (a node's
        busy GPUs, a fragment inferred before the rest moved with it): what its GPUs learned there (their
        offsets from peers of the same job) carries over, and a new inferred job takes over the history
        of the largest such part. Inference needs minutes of co-movement; learning and the baseline
        restarted from nothing then, an incident starting just after was learned as the job's usual."""
        last = self._last_gid
        if len(last) < len(joined):
            last = np.concatenate([last, np.full(len(joined) - len(last), -1, dtype=np.int64)])
        sizes = np.bincount(last[last >= 0]) if (last >= 0).any() else np.zeros(0, dtype=np.int64)
        for label, model in set(zip(inferred[joined].tolist(), slot_model[joined].tolist())):
            sel = joined & (inferred == label) & (slot_model == model)
            g = self.intern((INFERRED_JOB, label, model), t)
            new = self.first_seen[g] == t
            gid[sel] = ngid[sel] = g
            before = last[sel]
            parts, moved = np.unique(before[(before >= 0) & (before != g)], return_counts=True)
            whole = parts[moved == sizes[parts]] if len(parts) else parts
            if len(whole):
                self.carried[sel & np.isin(last, whole)] = True
            if new and len(parts):
                self.first_seen[g] = min(t, float(self.first_seen[parts].min()))
                self.dated[g] = bool(self.dated[parts].any())
                if len(whole):
                    self.absorbed.append((g, int(whole[np.argmax(sizes[whole])])))


class GroupMembers:
    """Which smoothed values feed which group's statistics: GPU-level members of every group, plus the
    node-level members of cluster-model groups. Kept while the per-slot group ids stay the same."""

    def __init__(self, gid: np.ndarray, ngid: np.ndarray, n_groups: int) -> None:
        self.gid, self.ngid, self.n_groups = gid, ngid, n_groups
        member_slot = np.flatnonzero(gid >= 0)
        extra = np.flatnonzero((ngid >= 0) & (ngid != gid))
        self.slots = np.concatenate([member_slot, extra])
        self.ids = np.concatenate([gid[member_slot], ngid[extra]])
        self.layout = GroupLayout(self.ids, n_groups, self.slots)

    def same(self, gid: np.ndarray, ngid: np.ndarray, n_groups: int) -> bool:
        """Whether these are the members for that grouping."""
        return n_groups == self.n_groups and equal(gid, self.gid) and equal(ngid, self.ngid)


def group_stats(
    gid: np.ndarray,
    ngid: np.ndarray,
    n_groups: int,
    levels: np.ndarray,
    fractions: np.ndarray,
    members: GroupMembers | None = None,
) -> Groups:
    """Group medians of the per-slot levels (4, n) and means of the throttle fractions (slow,
    power_cap) over `members` (built from gid/ngid when not given or not matching)."""
    if members is None or not members.same(gid, ngid, n_groups):
        members = GroupMembers(gid, ngid, n_groups)
    slots, ids = members.slots, members.ids
    has = ~np.isnan(levels[3, slots])
    size = np.bincount(ids[has], minlength=n_groups)
    slow, power_cap = group_means(fractions[:, slots], ids, n_groups)
    return Groups(gid, ngid, n_groups, size, members.layout.medians(levels), slow, power_cap, members)


class GroupHistory:
    """Ring of per-group medians per tick; the baseline is a high percentile over healthy ticks."""

    SERIES = ("sm", "power", "util", "clock")
    _LEVEL_ROWS = np.array(list(map(LEVELS.index, SERIES)))  # SERIES as rows of Groups.levels
    _NOISE_SERIES = ("sm", "power")  # the series a job-wide drop is read from
    _NOISE_ROWS = np.array(list(map(SERIES.index, _NOISE_SERIES)))

    def __init__(self, ring_ticks: int, percentile: float, min_ticks: int, lag_ticks: int) -> None:
        self.ring = ring_ticks
        self.percentile = percentile
        self.min_ticks = min_ticks
        self.lag = lag_ticks
        # How many standard deviations the baseline percentile sits above the median, were the levels
        # normal (NaN where that says nothing: at or below the median, or the maximum).
        self._z = NormalDist().inv_cdf(percentile / 100.0) if 50.0 < percentile < 100.0 else math.nan
        self.values = np.full((len(self.SERIES), 0, ring_ticks), np.nan)
        self.tick_of = np.full(ring_ticks, -1, dtype=np.int64)
        self.base = np.full((len(self.SERIES), 0), np.nan)
        self.middle = np.full((len(self.SERIES), 0), np.nan)
        self.noise = np.full((len(self._NOISE_ROWS), 0), np.nan)
        self.count = np.zeros(0, dtype=np.int64)
        self._starts = np.zeros(0, dtype=np.intp)

    def _fit(self, n_groups: int) -> None:
        """Grow per-group arrays to n_groups."""
        self.values = grown(self.values, n_groups, np.nan, axis=1)
        self.base = grown(self.base, n_groups, np.nan)
        self.middle = grown(self.middle, n_groups, np.nan)
        self.noise = grown(self.noise, n_groups, np.nan)
        self.count = grown(self.count, n_groups, 0)

    def record(self, k: int, groups: Groups, healthy: np.ndarray) -> None:
        """Store this tick's group medians; unhealthy ticks are stored as gaps."""
        self._fit(groups.n_groups)
        pos = k % self.ring
        self.tick_of[pos] = k
        self.values[:, :, pos] = np.where(healthy, groups.levels[self._LEVEL_ROWS], np.nan)

    def refresh(self, k: int, n_groups: int) -> None:
        """Recompute baselines from the ring (cheap enough every few ticks)."""
        self._fit(n_groups)
        live = (self.tick_of > k - self.ring) & (self.tick_of >= 0)
        vals = np.where(live[None, None, :], self.values, np.nan)
        srt = np.sort(vals, axis=2)
        cnt = (~np.isnan(srt)).sum(axis=2)
        flat, starts = srt.reshape(-1), self._row_starts(cnt.size)
        pct = flat[starts + self._rank(cnt, self.percentile)].reshape(cnt.shape)
        mid = flat[starts + self._rank(cnt, 50.0)].reshape(cnt.shape)
        enough = cnt >= self.min_ticks
        # Keep the last good baseline while a long incident leaves too few healthy ticks.
        self.base = np.where(enough, pct, self.base)
        self.middle = np.where(enough, mid, self.middle)
        self.count = cnt.max(axis=0)
        self._refresh_noise(live)

    def _refresh_noise(self, live: np.ndarray) -> None:
        """Each group's noise in the drop series: the spread of the changes between healthy ticks
        `lag` apart (1.4826 × their median absolute value, over √2: one reading's standard deviation).
        Changes over a minute, not levels: a history holding a slow trend or a recovery from an
        incident spreads its levels far wider than its noise. A job just back from a straggler, its
        power still climbing, read a 4 % spread from its levels, and a 10 % communication drop was
        taken for noise. Kept from the last refresh with enough pairs, like the baseline."""
        ring = np.arange(self.ring)
        partner = (ring - self.lag) % self.ring
        paired = (live & live[partner] & (self.tick_of - self.tick_of[partner] == self.lag)).nonzero()[0]
        # A level shift inside the history (a drop that came before the baseline could tell it) spans
        # at most `lag` pairs; with three times as many the median change stays a healthy one.
        need = max(self.min_ticks, 3 * self.lag)
        if len(paired) < need:
            return
        v = self.values[self._NOISE_ROWS]
        d = np.abs(v[:, :, paired] - v[:, :, partner[paired]])
        d.sort(axis=2)
        cnt = (~np.isnan(d)).sum(axis=2)
        half = d.reshape(-1)[np.arange(cnt.size) * len(paired) + np.maximum(cnt - 1, 0).ravel() // 2]
        sigma = half.reshape(cnt.shape) * (1.4826 / np.sqrt(2.0))
        self.noise = np.where(cnt >= need, sigma, self.noise)

    def _rank(self, cnt: np.ndarray, percentile: float) -> np.ndarray:
        """Flat offset of a percentile within each sorted row of `cnt` values."""
        idx = np.floor((cnt - 1) * percentile / 100.0).astype(np.int64)
        return np.minimum(np.maximum(idx, 0), self.ring - 1).ravel()

    def _row_starts(self, rows: int) -> np.ndarray:
        """Flat start of each of `rows` rows of the ring (one row per series and group)."""
        if len(self._starts) != rows:
            self._starts = np.arange(rows) * self.ring
        return self._starts

    def inherit(self, gid: int, source: int) -> None:
        """Group `gid` takes over the history of `source` (a part of it, absorbed whole)."""
        self._fit(max(gid, source) + 1)
        self.values[:, gid, :] = self.values[:, source, :]
        self.base[:, gid] = self.base[:, source]
        self.middle[:, gid] = self.middle[:, source]
        self.noise[:, gid] = self.noise[:, source]
        self.count[gid] = self.count[source]

    def reset(self, gids: np.ndarray) -> None:
        """Forget the history of groups whose operating regime changed (e.g. a new power cap)."""
        self.values[:, gids, :] = np.nan
        self.base[:, gids] = np.nan
        self.middle[:, gids] = np.nan
        self.noise[:, gids] = np.nan

    def baseline(self, name: str) -> np.ndarray:
        """Per-group baseline of one series (NaN until enough healthy history)."""
        return self.base[self.SERIES.index(name)]

    def median(self, name: str) -> np.ndarray:
        """Per-group median of one series over its healthy history (NaN until enough of it)."""
        return self.middle[self.SERIES.index(name)]

    def level_spread(self, name: str) -> np.ndarray:
        """Per-group standard deviation of one series read from its levels: the baseline's distance above
        the median over the normal quantile of the baseline's percentile. Known as soon as the baseline
        is, but a history holding a trend spreads its levels wider than its noise (see spread)."""
        i = self.SERIES.index(name)
        return (self.base[i] - self.middle[i]) / self._z

    def spread(self, name: str) -> np.ndarray:
        """Per-group standard deviation of one drop series ("sm" or "power") in its healthy history
        (NaN until enough of it)."""
        return self.noise[self._NOISE_SERIES.index(name)]
