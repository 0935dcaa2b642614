"""What node-level straggler detection learns across ticks, and how a tick's GPUs fall into (group, node)
pairs. Kept apart from the detection itself (nodes.py) so the straggler state can hold it without
importing the detector that reads that state."""

from __future__ import annotations

import numpy as np

from gpufleet.server.alerts import AlertKind
from gpufleet.server.engine.arrays import grown
from gpufleet.server.engine.detectors import subject_fingerprint
from gpufleet.server.engine.groups import GroupLayout
from gpufleet.server.engine.reduce import equal
from gpufleet.server.engine.tick import Tick

# A (group, node) pair's sort key is gid x this + nid: node ids stay below it, and the product of group
# ids below it with it fits int64.
_PAIR_KEY = np.iinfo(np.int32).max + 1
# What is learned per pair: its idle gap and its activity, each against the group's other nodes.
_PAIR_ROWS = ("idle_gap", "activity")


class NodeOffsets:
    """What node-level detection learns across ticks: each (group, node) pair's offsets from the group's
    other nodes (idle gap, activity) and how long it has learned, plus the pairs' layout and fingerprints."""

    def __init__(self) -> None:
        self.pair_index: dict[tuple[int, int], int] = {}
        self.pair_fps: list[str] = []
        self.pair_offset = np.full((len(_PAIR_ROWS), 0), np.nan)
        self.pair_learned = np.zeros(0, dtype=np.int64)
        # Each pair's mean activity against the other nodes, uncapped, and how many ticks of unslowed
        # running after its warm-up it was learned over (nodes._learn_wander).
        self.pair_mean = np.full(0, np.nan)
        self.pair_mean_learned = np.zeros(0, dtype=np.int64)
        # Each pair's usual wander of its activity about its offset while unslowed (a robust standard
        # deviation): few GPUs a node, and few nodes, make a noisy median.
        self.pair_noise = np.full(0, np.nan)
        # Each pair's own path: its activity against the other nodes followed fast (nodes._follow_path).
        self.pair_path = np.full(0, np.nan)
        self._all_keys: list[int] = []
        self._pair_keys = np.zeros(0, dtype=np.int64)
        self._pair_vals = np.zeros(0, dtype=np.int64)
        self._node_fps: dict[tuple[int, int], str] = {}
        self._node_layout: NodePairs | None = None

    def pair_slots(self, tick: Tick, gids: np.ndarray, nids: np.ndarray) -> np.ndarray:
        """Vectorised pair_slot: a sorted key table answers known pairs without Python per pair."""
        keys = gids * _PAIR_KEY + nids
        pos = np.searchsorted(self._pair_keys, keys)
        pos = np.minimum(pos, max(len(self._pair_keys) - 1, 0))
        known = (
            (len(self._pair_keys) > 0) & (self._pair_keys[pos] == keys)
            if len(self._pair_keys)
            else np.zeros(len(keys), bool)
        )
        if not known.all():
            for gg, nn in zip(gids[~known].tolist(), nids[~known].tolist()):
                self.pair_slot(tick, gg, nn)
            order = np.argsort(self._all_keys)
            self._pair_keys, self._pair_vals = np.asarray(self._all_keys)[order], np.arange(len(self._all_keys))[order]
            pos = np.searchsorted(self._pair_keys, keys)
        return self._pair_vals[pos]

    def node_pairs(self, tick: Tick, ng: np.ndarray, sel: np.ndarray, node_id: np.ndarray) -> NodePairs | None:
        """The (group, node) pairs of this tick's node-level members; None when no group spans two nodes.

        Membership rarely changes between ticks, so the layout is kept until the node-level group ids, the
        set of GPUs with data, or the number of nodes or groups change.
        """
        n_nodes, n_groups = len(tick.windows.node_names), tick.groups.n_groups
        lay = self._node_layout
        if (
            lay is not None
            and lay.n_nodes == n_nodes
            and lay.n_groups == n_groups
            and equal(lay.ng, ng)
            and equal(lay.sel, sel)
        ):
            return lay.usable
        lay = self._node_layout = NodePairs(self, tick, ng.copy(), sel.copy(), node_id, n_nodes, n_groups)
        return lay.usable

    def pair_slot(self, tick: Tick, gid: int, nid: int) -> int:
        """Index of a (group, node) pair in the node-offset arrays, registering it when new."""
        i = self.pair_index.get((gid, nid))
        if i is None:
            i = self.pair_index[(gid, nid)] = len(self.pair_fps)
            self._all_keys.append(gid * _PAIR_KEY + nid)
            self.pair_fps.append(self.node_fingerprint(tick, gid, nid))
            self.pair_offset = grown(self.pair_offset, i + 1, np.nan)
            self.pair_learned = grown(self.pair_learned, i + 1, 0)
            self.pair_mean = grown(self.pair_mean, i + 1, np.nan)
            self.pair_mean_learned = grown(self.pair_mean_learned, i + 1, 0)
            self.pair_noise = grown(self.pair_noise, i + 1, np.nan)
            self.pair_path = grown(self.pair_path, i + 1, np.nan)
        return i

    def recycle(self, gid: int, job: str | None, node_names: list[str]) -> None:
        """The group id went to a new group (job `job`): its pairs keep their slots, but start learning
        afresh under the new job's fingerprints."""
        for (g, nid), i in self.pair_index.items():
            if g == gid:
                self.pair_offset[:, i] = np.nan
                self.pair_learned[i] = 0
                self.pair_mean[i] = np.nan
                self.pair_mean_learned[i] = 0
                self.pair_noise[i] = np.nan
                self.pair_path[i] = np.nan
                fp = subject_fingerprint(AlertKind.STRAGGLER, node_names[nid], None, job)
                self.pair_fps[i] = self._node_fps[(g, nid)] = fp
        self._node_layout = None

    def node_fingerprint(self, tick: Tick, gid: int, nid: int) -> str:
        """Memoised fingerprint of a node-level straggler subject."""
        fp = self._node_fps.get((gid, nid))
        if fp is None:
            fp = self._node_fps[(gid, nid)] = subject_fingerprint(
                AlertKind.STRAGGLER, tick.windows.node_names[nid], None, tick.registry.job(gid)
            )
        return fp


class NodePairs:
    """Node-level members grouped into (group, node) pairs, and the pairs of groups spanning 2+ nodes."""

    def __init__(
        self,
        state: NodeOffsets,
        tick: Tick,
        ng: np.ndarray,
        sel: np.ndarray,
        node_id: np.ndarray,
        n_nodes: int,
        n_groups: int,
    ) -> None:
        self.ng, self.sel, self.n_nodes, self.n_groups = ng, sel, n_nodes, n_groups
        key = ng[sel] * n_nodes + node_id[sel]
        uniq, self.inv = np.unique(key, return_inverse=True)
        self.pair_group, pair_node = uniq // n_nodes, uniq % n_nodes
        self.per_group = np.bincount(self.pair_group, minlength=n_groups)
        multi = self.per_group[self.pair_group] > 1
        self.usable = self if multi.any() else None
        self.sel_pairs = np.flatnonzero(multi)
        self.gids, self.nids = self.pair_group[self.sel_pairs], pair_node[self.sel_pairs]
        self.idx: np.ndarray | slice = state.pair_slots(tick, self.gids, self.nids) if self.usable else self.sel_pairs
        # Pairs are registered in the order first seen, so the index is usually a plain range: a slice
        # reads and writes the learned offsets without copying through fancy indexing.
        if len(self.idx) and np.array_equal(self.idx, np.arange(self.idx[0], self.idx[0] + len(self.idx))):
            self.idx = slice(int(self.idx[0]), int(self.idx[0]) + len(self.idx))
        slots = range(len(state.pair_fps))[self.idx] if isinstance(self.idx, slice) else self.idx.tolist()
        self.pairs = {
            state.pair_fps[i]: (int(gg), int(nn)) for i, gg, nn in zip(slots, self.gids.tolist(), self.nids.tolist())
        }
        # Grouped medians over the same membership every tick: GPUs into pairs, pairs into groups.
        self.members = GroupLayout(self.inv, len(uniq), np.flatnonzero(sel))
        self.nodes_of_group = GroupLayout(self.pair_group, n_groups)
        self.three_or_more = bool((self.per_group - 1 > 1).any())  # more than one other node: a median
