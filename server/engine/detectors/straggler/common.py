"""What GPU-level and node-level straggler detection share: the rows they read, the clock-cut test and
how offsets are learned."""

from __future__ import annotations

import math

import numpy as np

from gpufleet.server.engine.detectors.straggler.policy import GPU_CLOCK_CUT
from gpufleet.server.engine.groups import LEVELS
from gpufleet.server.engine.rules import Rule, any_of, evaluate
from gpufleet.server.engine.tick import Tick
from gpufleet.server.engine.windows import B_CLOCK_RATIO, B_POWER, B_SLOW, B_SM, B_UTIL

# Rows of the levels, as groups.LEVELS.
SM, PW, CLK, UTIL = range(len(LEVELS))
# Binned rows of the newest readings: the levels (as groups.LEVELS), then the slowdown-bit share.
NOW_ROWS = np.array([B_SM, B_POWER, B_CLOCK_RATIO, B_UTIL, B_SLOW])


def scales(cfg) -> np.ndarray:
    """detect() asks for every culprit signal at the configured margins and at the weaker share of them
    (enough to suppress workload alerts and to keep an open alert from clearing) in one pass: (2, 1)."""
    return np.array([[1.0], [cfg.straggler_weak_margin_ratio]])


def percent(ratio: float) -> str:
    """A ratio as a whole percentage with a spaced sign, for summaries ('15 %')."""
    return f"{ratio:.0%}"[:-1] + " %"


def clock_cut(
    cfg, clk_dev: np.ndarray, slow: np.ndarray, peer_slow: np.ndarray, rules: tuple[Rule, ...] = GPU_CLOCK_CUT
) -> np.ndarray:
    """Clocks cut below the peers' by the clock margin (clk_dev: SM clock ratio against the peers', - 1),
    with slowdown bits (HW slowdown, power brake, thermal) that the peers do not have (either alone where
    the other is not reported). Per GPU against its group, or per node against the group's other nodes.

    In a synchronous job such a GPU is slower than its peers whatever else it reads, so this counts as
    the cross-sectional "peers wait for it" evidence with no baseline needed (a braked GPU draws *less*
    power than its spinning peers, so power alone would never name it). Nothing is learned from such a
    GPU: an offset learned while braked would set the recovered GPU apart.
    """
    shared = peer_slow >= cfg.straggler_peer_slow_bits_share
    arrays = {
        "cut_deficit": -clk_dev,
        "slow_share": slow,
        # A driver without SM clocks leaves the bits alone (as in gpus.signals); one without throttle
        # reasons, the clock deficit alone.
        "own_bits": (slow >= cfg.straggler_slow_bits_share) & ~shared,
        "peer_bits": shared,
        "clock_unsupported": np.isnan(clk_dev),
        "bits_unsupported": np.isnan(slow),
    }
    return any_of(evaluate(rules, arrays, cfg), [r.name for r in rules])


def learning_rate(cfg, learned: np.ndarray, free: np.ndarray | bool) -> np.ndarray:
    """Offset learning rate per tick, from how many ticks each offset has learned: fast while warming up
    (forgetting the ramp-up), then following slowly with the configured time constant.

    free: offsets not bounded to a job's structural range (outside jobs). Those take the running mean of
    the readings after the warm-up (the warm-up's estimate counting as 1 / straggler_fast_learning_ratio
    readings) until that is slower than the time constant, since a fast moving average keeps only its
    last few readings (a noisy warm-up's dip). Inside a job the offset is capped to the structural range
    instead: learning faster there would absorb a straggler's excess before its job's slowdown is clear."""
    warm_ticks = cfg.bins(cfg.startup_grace_seconds)
    slow = 1.0 - math.exp(-cfg.tick_seconds / cfg.offset_time_constant_seconds)
    since_warm = np.maximum(learned - warm_ticks, 0) + 1.0 / cfg.straggler_fast_learning_ratio + 1.0
    after = np.where(free, np.maximum(1.0 / since_warm, slow), slow)
    return np.where(learned < warm_ticks, cfg.straggler_fast_learning_ratio, after)


def follow(cur: np.ndarray, x: np.ndarray, learn: np.ndarray, alpha: np.ndarray | float) -> np.ndarray:
    """Exponential moving average step where learning and x is known; the first value is taken as is."""
    ok = learn & ~np.isnan(x)
    return np.where(ok, np.where(np.isnan(cur), x, cur + alpha * (x - cur)), cur)


def newest(tick: Tick, rows: np.ndarray) -> np.ndarray | None:
    """Each slot's newest reading of some binned rows, shape (len(rows), n): its newest bin's mean, or
    the newest of the bins before (straggler_newest_bins in all) that has a sample (every other bin at
    10 s sampling); None before the tick holds that many bins."""
    k = tick.config.straggler_newest_bins
    if len(tick.held) < k:
        return None
    # The newest bin is the tick's own (Tick.latest); only the bins before it are read from the windows.
    bins = [tick.latest[rows]]
    if k > 1:
        bins += list(tick.windows.recent(tick.k - 1, k - 1, rows, tick.held[1:k]))  # newest first
    out = bins[-1]
    for i in reversed(range(k - 1)):
        out = np.where(tick.held[i], bins[i], out)
    return out
