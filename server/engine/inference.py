"""Peer groups inferred without attribution: the GPUs of one synchronous job move together.

The ranks of a synchronous training job are in the same phase of the same step at the same instant: what
one sampling interval catches (a little more compute, a little more collective) raises or lowers the SM
activity, and the power, of every GPU of the job at once. GPUs of different jobs step independently, so
their readings' wobbles are uncorrelated. Over the engine's window the correlation of two GPUs'
wobbles (each reading's change from the one before, clipped against steps) is high within a job and near
zero between jobs; a single pair's estimate is noisy, an average over a job's many pairs is not. GPUs of
one model are clustered by average linkage: two clusters merge while the mean correlation between their
members is at least `inferred_min_correlation`, so one lucky pair cannot join two jobs.

A cluster of at least `straggler_min_group` GPUs is an inferred job. Its label is kept across
re-inference as long as most of its members stay, so the group's history survives. The detectors treat
an inferred job as one job (groups.GroupRegistry.one_job) but say in every alert that its peers were
inferred; unattributed GPUs in no cluster keep the fallback groups, which may mix jobs and so never name
a node.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from gpufleet.server.engine.config import EngineConfig
from gpufleet.server.engine.groups import CLUSTER_MODEL, INFERRED_JOB, GroupRegistry
from gpufleet.server.engine.windows import B_POWER, B_SM, B_UTIL, Windows

# Relative size of float rounding in a difference of readings (a few ulps of them).
_ROUNDING = 64 * np.finfo(np.float64).eps
NONE = -1


def wobbles(series: np.ndarray, clip_sigmas: float) -> tuple[np.ndarray, np.ndarray]:
    """Per GPU (columns of a (bins, n) series, NaN: no sample): the change from each reading to the next,
    in robust standard deviations clipped at clip_sigmas, then standardised; zero where unknown. Also
    the mask of known values (a row per pair of consecutive bins).

    Changes, not distances from a moving average: a step (a job's start-up ending, an incident) is one
    large change, clipped to one bin's weight; as a distance from a moving average it spread over as many
    bins as the average spans, and two jobs whose start-ups ended within a few bins of each other looked
    like one job."""
    change = series[:-1] - series[1:]
    # Equal readings differ by rounding alone, alike on every GPU that reads the same constant: no change.
    change[np.abs(change) <= _ROUNDING * np.abs(series[1:])] = 0.0
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a GPU without readings: its median is NaN
        mad = np.nanmedian(np.abs(change), axis=0) * 1.4826
    # A reading that never wobbles (a constant, a stuck sensor) says nothing about what it moves with.
    wobbly = mad > 0
    z = np.clip(change / np.where(wobbly, mad, 1.0), -clip_sigmas, clip_sigmas)
    ok = ~np.isnan(z) & wobbly[None, :]
    z = np.where(ok, z, 0.0)
    n_ok = ok.sum(axis=0)
    mean = z.sum(axis=0) / np.maximum(n_ok, 1)
    z = np.where(ok, z - mean, 0.0)
    norm = np.sqrt((z**2).sum(axis=0) / np.maximum(n_ok, 1))
    z = np.where(norm > 0, z / np.where(norm > 0, norm, 1.0), 0.0)
    return z, ok & (norm > 0)


def average_linkage(corr: np.ndarray, min_corr: float, min_relative: float = 0.0) -> np.ndarray:
    """Cluster index per row of a correlation matrix: repeatedly merge the two clusters with the highest
    mean correlation between their members (unknown pairs count as zero) while it is >= min_corr. Two
    clusters of two or more also need that mean to be min_relative of the geometric mean of their own
    internal means: a job's GPUs move with each other as much across a split as within it, while two
    jobs' step phases correlate only by chance, which over one window and many jobs reached 0.37.

    Two clusters can merge only if some pair across them reaches min_corr, so each connected set of such
    pairs is clustered on its own: a fleet's jobs, not the whole fleet, set the cost (cubic in size)."""
    label = np.arange(len(corr))
    linked = np.nan_to_num(corr, nan=0.0) >= min_corr
    part = _components(linked)
    for p in np.unique(part).tolist():
        rows = np.flatnonzero(part == p)
        if len(rows) > 1:
            label[rows] = rows[_linkage(corr[np.ix_(rows, rows)], min_corr, min_relative)]
    return label


def _components(linked: np.ndarray) -> np.ndarray:
    """Connected components of a symmetric boolean adjacency matrix: the smallest row index reachable."""
    comp = np.arange(len(linked))
    while True:
        reach = np.where(linked, comp[None, :], len(comp)).min(axis=1)
        nxt = np.minimum(comp, reach)
        nxt = nxt[nxt]  # jump along what is known already: rounds grow with log of the diameter
        if (nxt == comp).all():
            return comp
        comp = nxt


def _linkage(corr: np.ndarray, min_corr: float, min_relative: float) -> np.ndarray:
    """average_linkage within one connected set. Each cluster's best partner is kept and only the rows a
    merge touched are searched again, so a merge costs a row, not the whole matrix."""
    n = len(corr)
    label = np.arange(n)
    total = np.nan_to_num(corr, nan=0.0)  # summed correlation between clusters
    np.fill_diagonal(total, 0.0)
    size = np.ones(n)
    alive = np.ones(n, dtype=bool)
    mean = total.copy()
    np.fill_diagonal(mean, -np.inf)
    best = mean.argmax(axis=1)
    best_val = mean[np.arange(n), best]
    inside = np.zeros(n)  # per cluster: summed correlation of its own pairs
    while True:
        a = int(np.argmax(best_val))
        if not best_val[a] >= min_corr:
            return label
        b = int(best[a])
        if size[a] > 1 and size[b] > 1:
            own = inside[[a, b]] / (size[[a, b]] * (size[[a, b]] - 1) / 2)
            if not best_val[a] >= min_relative * np.sqrt(max(own[0], 0.0) * max(own[1], 0.0)):
                # Not one job: this pair of clusters never merges; each looks for its next best.
                mean[a, b] = mean[b, a] = -np.inf
                for i in (a, b):
                    best[i] = int(mean[i].argmax())
                    best_val[i] = mean[i, best[i]]
                continue
        # b joins a
        inside[a] += inside[b] + total[a, b]
        total[a, :] += total[b, :]
        total[:, a] = total[a, :]
        total[a, a] = 0.0
        size[a] += size[b]
        alive[b] = False
        label[label == b] = a
        row = total[a] / (size[a] * size)
        row[~alive] = -np.inf
        row[a] = -np.inf
        mean[a, :] = row
        mean[:, a] = row
        mean[b, :] = -np.inf
        mean[:, b] = -np.inf
        best_val[b] = -np.inf
        stale = alive & ((best == a) | (best == b))
        stale[a] = True
        rows = np.flatnonzero(stale)
        best[rows] = mean[rows].argmax(axis=1)
        best_val[rows] = mean[rows, best[rows]]
        better = alive & ~stale & (row > best_val)
        best[better] = a
        best_val[better] = row[better]


def lagged_correlation(z: np.ndarray, ok: np.ndarray, min_common: int) -> np.ndarray:
    """Pairwise correlation (n, n) of standardised wobbles (rows: bins, newest first) over the rows both
    GPUs have, NaN where they share fewer than min_common. Nodes sample at their own phase: one node's
    sample of an interval can land in the bin after another's, so a pair's correlation is the largest of
    no shift and one row's shift either way."""
    okf = ok.astype(float)
    out = np.full((z.shape[1], z.shape[1]), -np.inf)
    common = okf.T @ okf
    with np.errstate(invalid="ignore", divide="ignore"):
        for lag in (0, 1):
            n = len(z) - lag
            if n <= 0:
                continue
            both = okf[:n].T @ okf[lag : lag + n]
            corr = (z[:n].T @ z[lag : lag + n]) / both
            corr[both < min_common] = -np.inf
            out = np.fmax(out, np.fmax(corr, corr.T))
    out[~np.isfinite(out) | (common < min_common)] = np.nan
    np.fill_diagonal(out, np.nan)
    return out


def _sure(corr: np.ndarray, members: np.ndarray, node: np.ndarray, min_share: float, min_across: float) -> bool:
    """Whether a cluster (members: a mask over the clustered GPUs; node: their node ids; corr: their
    correlations, NaN as zero) is sure enough to be taken for a job: on one node; or holding at least
    min_share of the clustered GPUs of each node it touches (a job less a straggler or two that stopped
    moving with it); or at least half of them, its GPUs on different nodes moving together by min_across
    on average.

    Where no job's ranks share a wobble (steps too regular for one sample to catch more of one phase),
    what moves together is a node's GPUs (read at one instant), and average linkage still joins parts
    of nodes whose noise happened to agree: fragments that split nodes and mix jobs, their GPUs on
    different nodes barely correlated. Compared as a job, a fragment hides the straggler its node's own
    GPUs would show. A job sharing its nodes with another takes a block of each (half, a quarter) and
    its ranks move together across nodes as much as within one."""
    on = node[members]
    nodes, held = np.unique(on, return_counts=True)
    if len(nodes) == 1:
        return True
    clustered = np.bincount(node, minlength=int(node.max()) + 1)[nodes]
    if (held >= min_share * clustered).all():
        return True
    if not (2 * held >= clustered).all():
        return False
    across = on[:, None] != on[None, :]
    return bool(corr[np.ix_(members, members)][across].mean() >= min_across)


def _level_parts(level: np.ndarray, node: np.ndarray, cfg: EngineConfig) -> list[np.ndarray]:
    """A cluster's members (their levels over the window: SM activity or power; their node ids) as one
    job, or as two where they fall into two levels apart by inferred_split_level_ratio, each part at least
    straggler_min_group GPUs and on every node of the cluster.

    Two jobs sharing nodes (each a block of every node) can move together where their steps share no
    wobble and a node's GPUs, read at one instant, do: then their different loads are set against one
    median and the busier job's GPUs stand out. A job's own ranks differ in level by role, but a role is
    contiguous in rank (a pipeline stage on one node), and a straggler is one GPU or one node. Split, a
    GPU without a level joins neither part."""
    known = ~np.isnan(level)
    nodes = np.unique(node)
    least = cfg.straggler_min_group
    if len(nodes) < 2 or np.count_nonzero(known) < 2 * least:
        return [np.ones(len(level), dtype=bool)]
    ordered = np.sort(level[known])
    ratio = ordered[1:] / np.maximum(ordered[:-1], _ROUNDING) - 1.0
    ratio[: least - 1] = ratio[len(ratio) - least + 1 :] = -np.inf  # each part at least `least` GPUs
    cut = int(np.argmax(ratio))
    if not ratio[cut] >= cfg.inferred_split_level_ratio:
        return [np.ones(len(level), dtype=bool)]
    high = known & (level > ordered[cut])
    low = known & ~high
    # Each job's GPUs lie closer together than the gap between the jobs; levels spread by a job's ramp-up
    # or noise have gaps as wide within a part as between the parts.
    spread = max(ordered[cut] / max(ordered[0], _ROUNDING), ordered[-1] / ordered[cut + 1]) - 1.0
    if not ratio[cut] >= spread or not all(np.isin(nodes, node[part]).all() for part in (low, high)):
        return [np.ones(len(level), dtype=bool)]
    return [low, high]


def _held_node(on_node: np.ndarray, label: int, cfg: EngineConfig) -> bool:
    """Whether `label` holds most of a node's GPUs (on_node: their labels): at least
    straggler_min_group, and inferred_min_node_share of them all (a job less a straggler or two, as in
    _sure)."""
    inside = np.count_nonzero(on_node == label)
    return bool(inside >= cfg.straggler_min_group and inside >= cfg.inferred_min_node_share * len(on_node))


def _join_node_mates(
    fresh: np.ndarray, corr: np.ndarray, node: np.ndarray, model: np.ndarray, cfg: EngineConfig
) -> np.ndarray:
    """Clusters (fresh, NONE: in none) with each GPU in none joined to the cluster holding every other GPU
    of its model on its node (at least inferred_min_node_share of them, see _held_node), where it moves
    with that cluster's GPUs on other nodes by inferred_node_join_min_correlation on average. One rank's
    wobble can correlate with its job's less than average linkage asks (0.13-0.23 against 0.25-0.45 for
    its node's other GPUs, in a step-level model), and a straggler's stops doing so from its first
    slowed step: left in no job it has no peers, and is never named. Only the one GPU left out of its
    node: two or more are as likely another job's, whose wobble reads 0.18-0.23 against a cluster that
    took some of their node-mates."""
    out = fresh.copy()
    for i in np.flatnonzero(fresh == NONE).tolist():
        mates = (model == model[i]) & (node == node[i])
        jobs = np.unique(fresh[mates & (fresh != NONE)])
        if len(jobs) != 1 or np.count_nonzero(fresh[mates] == NONE) > 1:
            continue
        if not _held_node(fresh[mates], int(jobs[0]), cfg):
            continue
        away = (fresh == jobs[0]) & (node != node[i])
        if away.any() and corr[i, away].mean() >= cfg.inferred_node_join_min_correlation:
            out[i] = jobs[0]
    return out


def _fill(held: np.ndarray) -> float:
    """Median over GPUs (columns; rows newest first) of the share of bins holding a sample, from each
    GPU's first sample on: bins before it (a trace or a node just begun) say nothing of its interval."""
    rows = np.arange(len(held))[:, None]
    first = np.where(held, rows, -1).max(axis=0)  # the oldest row with a sample
    span = first + 1
    ok = span > 0
    if not ok.any():
        return 0.0
    return float(np.median(held.sum(axis=0)[ok] / span[ok]))


class JobInference:
    """Inferred job label per slot (NONE: in no inferred job), re-inferred every inferred_refresh_seconds
    from the window's SM activity (power where SM activity is unsupported), labels kept stable.

    While an unattributed group is in trouble (its peers slowed, or someone standing out), the GPUs of
    its model keep their labels: an incident changes how a job's GPUs move for minutes (a slow node computes all the time and
    no longer wobbles with the others), and re-inferred then, the job fell apart into its nodes just as one
    of them became its straggler.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.labels = np.full(0, NONE, dtype=np.int64)
        self._next_label = 0
        self._last_k: int | None = None
        self._apart_since = np.full(0, -1, dtype=np.int64)  # per slot: the tick it fell out of its job

    def update(
        self, k: int, w: Windows, candidates: np.ndarray, model: np.ndarray, hold: np.ndarray | None = None
    ) -> np.ndarray:
        """Labels for this tick: candidates are the unattributed GPUs running work now; `hold`: the slots
        whose group is in trouble (their GPU model keeps its labels at a re-inference)."""
        cfg = self.config
        n = len(candidates)
        if len(self.labels) < n:
            self.labels = np.concatenate([self.labels, np.full(n - len(self.labels), NONE, dtype=np.int64)])
        due = self._last_k is None or k - self._last_k >= cfg.bins(cfg.inferred_refresh_seconds)
        if due and candidates.any():
            self._last_k = k
            held = np.zeros(n, dtype=bool)
            if hold is not None:
                m = min(n, len(hold))  # slots registered since hold was taken hold nothing
                held[:m] = hold[:m] & candidates[:m]
            self.labels[:n][~candidates] = NONE
            # The whole model waits: its GPUs would form fragments of the disturbed job (a host-starved
            # node's last GPUs with a few of the nodes waiting for it; a braked GPU's node apart).
            frozen = candidates & np.isin(model, model[held])
            self._infer(k, w, candidates & ~frozen, model, set(self.labels[:n][frozen].tolist()))
        return np.where(candidates, self.labels[:n], NONE)

    def _infer(self, k: int, w: Windows, candidates: np.ndarray, model: np.ndarray, reserved: set[int]) -> None:
        """Cluster the candidates afresh (`reserved`: the labels held meanwhile)."""
        cfg = self.config
        bins = min(w.ring, k + 1)
        slots = np.flatnonzero(candidates)
        if not len(slots):
            return
        window = w.recent(k, bins, [B_SM, B_POWER, B_UTIL])[:, :, slots]  # newest first
        # Sampled less often than once a bin (10 s agents, 5 s ticks), nodes fill different bins: readings
        # are compared over blocks of as many bins as one sample spans.
        fill = _fill(~np.isnan(window[:, 2]))
        block = max(1, int(round(1.0 / fill))) if fill > 0 else 1
        # Only bins in which the GPU ran kernels count: jobs that start or end together ramp together.
        running = window[:, 2] >= cfg.unattributed_running_utilization
        window = np.where(running[:, None, :], window[:, :2], np.nan)
        if block > 1:
            usable = (bins // block) * block
            with np.errstate(invalid="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                window = np.nanmean(window[:usable].reshape(usable // block, block, 2, len(slots)), axis=1)
        sm, power = window[:, 0], window[:, 1]
        # SM activity where a GPU reports it over most of the window, else power.
        by_sm = (~np.isnan(sm)).sum(axis=0) * 2 >= (~np.isnan(power)).sum(axis=0)
        series = np.where(by_sm[None, :], sm, power)
        min_common = cfg.bins(cfg.inferred_min_seconds)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a GPU without readings: its level is NaN
            level = np.nanmedian(series, axis=0)
        z, ok = wobbles(series, cfg.inferred_clip_sigmas)
        corr = lagged_correlation(z, ok, min_common)
        fresh = np.full(len(slots), NONE, dtype=np.int64)
        node = w.slot_node_id[slots]
        n_found = 0
        for m in np.unique(model[slots]).tolist():
            for source in (True, False):
                pick = np.flatnonzero((model[slots] == m) & (by_sm == source))
                if len(pick) < cfg.straggler_min_group:
                    continue
                clusters = average_linkage(
                    corr[np.ix_(pick, pick)], cfg.inferred_min_correlation, cfg.inferred_min_relative_correlation
                )
                sub = np.nan_to_num(corr[np.ix_(pick, pick)], nan=0.0)
                ids, counts = np.unique(clusters, return_counts=True)
                for c in ids[counts >= cfg.straggler_min_group].tolist():
                    sure = _sure(
                        sub, clusters == c, node[pick], cfg.inferred_min_node_share, cfg.inferred_split_min_correlation
                    )
                    if not sure:
                        continue
                    members = pick[clusters == c]
                    for part in _level_parts(level[members], node[members], cfg):
                        fresh[members[part]] = n_found
                        n_found += 1
        fresh = _join_node_mates(fresh, np.nan_to_num(corr, nan=0.0), node, model[slots], cfg)
        old = self.labels[slots].copy()
        self._relabel(slots, fresh, reserved)
        self._keep_fallen_out(k, slots, old, node)

    def _keep_fallen_out(self, k: int, slots: np.ndarray, old: np.ndarray, node: np.ndarray) -> None:
        """A GPU that fell out of its inferred job into no cluster, while the job lives on under its
        label and holds most of the GPUs of its node (_held_node), stays in it for up to
        inferred_keep_seconds. A straggler computes through the all-reduce its peers wait in: from its
        first slowed step it wobbles against them, not with them, and the next inference left it alone,
        with no peers to be named against, just before they slowed enough to hold the labels
        (JobInference.update's hold). A GPU that moved to another job joins that job's cluster, and the
        GPUs of another job that moved with this one for a while leave it with their nodes."""
        if len(self._apart_since) < len(self.labels):
            grow = np.full(len(self.labels) - len(self._apart_since), -1, dtype=np.int64)
            self._apart_since = np.concatenate([self._apart_since, grow])
        new = self.labels[slots]
        fell = (new == NONE) & (old != NONE)
        for i in np.flatnonzero(fell).tolist():
            fell[i] = _held_node(new[node == node[i]], int(old[i]), self.config)
        since = np.where(fell & (self._apart_since[slots] < 0), k, self._apart_since[slots])
        since[~fell] = -1
        self._apart_since[slots] = since
        keep = fell & (k - since < self.config.bins(self.config.inferred_keep_seconds))
        self.labels[slots[keep]] = old[keep]

    def _relabel(self, slots: np.ndarray, fresh: np.ndarray, reserved: set[int]) -> None:
        """Give each new cluster the label of the old inferred job holding most of its members (when
        they are most of it), a new label otherwise; slots outside any cluster lose theirs."""
        old = self.labels[slots]
        new = np.full(len(slots), NONE, dtype=np.int64)
        clusters = [c for c in np.unique(fresh).tolist() if c != NONE]
        # Largest clusters first: they claim their old label before a fragment of the same job does.
        clusters.sort(key=lambda c: -int(np.count_nonzero(fresh == c)))
        taken = set(reserved)
        for c in clusters:
            members = fresh == c
            prev, counts = np.unique(old[members & (old != NONE)], return_counts=True)
            label = NONE
            if len(prev):
                best = int(prev[np.argmax(counts)])
                if 2 * int(counts.max()) > int(members.sum()) and best not in taken:
                    label = best
            if label == NONE:
                label = self._next_label
                self._next_label += 1
            taken.add(label)
            new[members] = label
        self.labels[slots] = new


def inferred_peers(registry: GroupRegistry, gid: int, evidence: dict[str, Any]) -> None:
    """Mark a finding's evidence when its peer group was inferred (no hpc_job attribution)."""
    if not registry.inferred(gid):
        return
    evidence["peer_group_inferred"] = True
    if registry.kind(gid) == INFERRED_JOB:
        evidence["note"] = (
            "no hpc_job attribution: peers inferred as one job from GPUs of the same model whose activity "
            "rises and falls with this one's"
        )
    elif registry.kind(gid) == CLUSTER_MODEL:
        evidence["note"] = (
            "no hpc_job attribution and no job inferred: compared with every unattributed GPU of its model, "
            "named while it idles on its host and other nodes' GPUs wait, spinning"
        )


def inferred_suffix(evidence: dict[str, Any]) -> str:
    """The words a summary ends with when its peers were inferred."""
    return " (peers inferred: no hpc_job attribution)" if evidence.get("peer_group_inferred") else ""
