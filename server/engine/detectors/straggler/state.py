"""What the straggler detector learns across ticks."""

from __future__ import annotations

from typing import Iterable

import numpy as np

from gpufleet.server.alerts import AlertKind
from gpufleet.server.engine.arrays import grown
from gpufleet.server.engine.detectors import FingerprintIndex
from gpufleet.server.engine.detectors.straggler.node_pairs import NodeOffsets
from gpufleet.server.engine.detectors.straggler.steps import StepTrail
from gpufleet.server.engine.groups import LEVELS
from gpufleet.server.engine.tick import Tick
from gpufleet.server.engine.windows import CounterEvent

# The levels a GPU's own usual level is kept for: SM activity and power, LEVELS' first two rows.
_OWN_LEVELS = LEVELS[: LEVELS.index("power") + 1]
# Counter event kinds (server/readings.py) that are a link retrying: NVLink replays and recoveries after
# CRC errors, PCIe replays. Each retry stalls the transfer, so a GPU whose links retry is slow for it.
LINK_RETRY_KINDS = ("nvlink_replay", "nvlink_recovery", "nvlink_crc_flit", "nvlink_crc_data", "pcie_replay")


class StragglerState:
    """Per GPU: structural offsets from its peers, its own usual SM activity and power, time on the job,
    and its group's recent spread of activity excesses; per node, its NodeOffsets; per subject, the cost
    so far; and the alerts' fingerprint index."""

    def __init__(self) -> None:
        self.offset = np.full((len(LEVELS), 0), np.nan)
        self.level = np.full((len(_OWN_LEVELS), 0), np.nan)  # usual SM activity and power
        self.learned_gid = np.full(0, -1, dtype=np.int64)
        self.learned = np.zeros(0, dtype=np.int64)
        # Its stable offset from its peers' SM activity and power, uncapped (a difference of role), and
        # how many ticks of healthy running after its warm-up it was learned over (gpus.learn).
        self.role = np.full((len(_OWN_LEVELS), 0), np.nan)
        self.role_learned = np.zeros(0, dtype=np.int64)
        # How far its SM activity and power usually wander from its usual level while unslowed (a robust
        # standard deviation): an expert whose load drifts wanders far, a steady rank by its noise.
        self.wander = np.full((len(_OWN_LEVELS), 0), np.nan)
        # Its own path: its SM activity's and power's deviation from its peers, followed fast (gpus.follow_path).
        self.path = np.full((len(_OWN_LEVELS), 0), np.nan)
        self.spread = np.full(0, np.nan)  # its group's recent spread of activity excesses
        self.noise = np.full((len(LEVELS), 0), np.nan)  # its group's spread of each excess while unslowed
        self.cost: dict[str, tuple[float, float]] = {}
        self._steady = np.full(0, np.nan)
        self.nodes = NodeOffsets()
        self.steps = StepTrail()  # recent bins against the peers, and steps found (steps.py)
        # The same against a node's busy GPUs, for GPUs in no job (stages._node_steps): kept across restarts.
        self.node_steps = StepTrail()
        # Per GPU: its inferred job's trail could find its steps since it was last out of work (then the
        # job judges it, not its node).
        self.job_steps_settled = np.zeros(0, dtype=bool)
        self.index = FingerprintIndex(AlertKind.STRAGGLER)
        # Per GPU: its links' recent retries, (time, event kind, count), oldest first.
        self.link_retries: dict[int, list[tuple[float, str, int]]] = {}
        # Per GPU: the start of the bin from which it has stood out in every newest reading (NaN: not now).
        self.standing_since = np.full(0, np.nan)

    def note_standing(self, bin_start: float, bin_seconds: float, standing: np.ndarray, fresh: np.ndarray) -> None:
        """One tick's standing in the newest readings (gpus.standing_now): a run starts at its first bin,
        and a bin without a sample of the GPU (`fresh` False) neither breaks it nor counts towards it."""
        since = grown(self.standing_since, len(standing), np.nan)[: len(standing)]
        started = np.where(np.isnan(since), bin_start, since)
        self.standing_since = np.where(fresh, np.where(standing, started, np.nan), since + bin_seconds)

    def note_link_retries(self, events: Iterable[CounterEvent], t: float, keep_seconds: float) -> None:
        """Keep the link-retry events of this tick and drop those older than keep_seconds."""
        for e in events:
            if e.kind in LINK_RETRY_KINDS:
                self.link_retries.setdefault(e.slot, []).append((e.time, e.kind, e.delta))
        if self.link_retries:
            since = t - keep_seconds
            kept = {slot: [r for r in rs if r[0] >= since] for slot, rs in self.link_retries.items()}
            self.link_retries = {slot: rs for slot, rs in kept.items() if rs}

    def link_retry_counts(self, slot: int) -> dict[str, int]:
        """Its links' retries kept now, summed by event kind."""
        out: dict[str, int] = {}
        for _, kind, delta in self.link_retries.get(slot, ()):
            out[kind] = out.get(kind, 0) + delta
        return out

    def forget(self, slots: np.ndarray) -> None:
        """Learn these GPUs afresh (their group's work changed)."""
        if len(slots):
            self.fit(int(slots.max()) + 1)
            self.offset[:, slots] = np.nan
            self.level[:, slots] = np.nan
            self.learned[slots] = 0
            self.role[:, slots] = np.nan
            self.role_learned[slots] = 0
            self.wander[:, slots] = np.nan
            self.path[:, slots] = np.nan
            self.spread[slots] = np.nan
            self.noise[:, slots] = np.nan
            self.standing_since[slots[slots < len(self.standing_since)]] = np.nan
            self.steps.forget(slots)
            for slot in slots.tolist():
                self.link_retries.pop(int(slot), None)

    def fit(self, n: int) -> None:
        """Grow per-slot arrays to n slots."""
        self.offset = grown(self.offset, n, np.nan)
        self.level = grown(self.level, n, np.nan)
        self.learned_gid = grown(self.learned_gid, n, -1)
        self.learned = grown(self.learned, n, 0)
        self.role = grown(self.role, n, np.nan)
        self.role_learned = grown(self.role_learned, n, 0)
        self.wander = grown(self.wander, n, np.nan)
        self.path = grown(self.path, n, np.nan)
        self.spread = grown(self.spread, n, np.nan)
        self.noise = grown(self.noise, n, np.nan)

    def recycle(self, gid: int, job: str | None, node_names: list[str]) -> None:
        """The group id went to a new group: what was learned about the old one's nodes and its waiting
        streak is not the new one's (its GPUs' offsets go in forget())."""
        if gid < len(self._steady):
            self._steady[gid] = np.nan
        self.nodes.recycle(gid, job, node_names)

    def add_cost(self, fp: str, t: float, gpu_hours: float) -> float:
        """Accumulate GPU-hours lost for a subject; returns the total so far."""
        total, _ = self.cost.get(fp, (0.0, t))
        total += gpu_hours
        self.cost[fp] = (total, t)
        return total

    def steady_since(self, tick: Tick, cfg) -> np.ndarray:
        """Per group: since when its median utilization has been at the 'waiting' level (NaN: not now)."""
        grp = tick.groups
        self._steady = grown(self._steady, grp.n_groups, np.nan)
        steady = grp.util >= cfg.straggler_waiting_utilization
        self._steady[: grp.n_groups] = np.where(steady, np.fmin(self._steady[: grp.n_groups], tick.t), np.nan)
        return self._steady[: grp.n_groups]

    def prune(self, t: float, keep_seconds: float) -> None:
        """Forget cost tallies of subjects quiet for longer than keep_seconds."""
        stale = [fp for fp, (_, last) in self.cost.items() if t - last > keep_seconds]
        for fp in stale:
            del self.cost[fp]
