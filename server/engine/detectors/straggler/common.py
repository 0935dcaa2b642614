"""What GPU-level and node-level straggler detection share: the rows they read, the clock-cut test and
how offsets are learned."""

from __future__ import annotations

import math

import numpy as np

from gpufleet.server.engine.tick import Tick
from gpufleet.server.engine.windows import B_CLOCK_RATIO, B_POWER, B_SLOW, B_SM, B_UTIL

# Rows of the levels, as groups.LEVELS.
SM, PW, CLK, UTIL = range(4)
# Binned rows of the newest readings: the levels (as groups.LEVELS), then the slowdown-bit share.
NOW_ROWS = np.array([B_SM, B_POWER, B_CLOCK_RATIO, B_UTIL, B_SLOW])
_FAST_ALPHA = 0.3
# detect() asks for every culprit signal at the configured margins and at 0.6 x them (weaker: enough
# to suppress workload alerts and to keep an open alert from clearing) in one pass.
SCALES = np.array([[1.0], [0.6]])


def clock_cut(cfg, clk_dev: np.ndarray, slow: np.ndarray, peer_slow: np.ndarray) -> np.ndarray:
    """Clocks cut below the peers' by the clock margin (clk_dev: SM clock ratio against the peers', - 1),
    with slowdown bits (HW slowdown, power brake, thermal) that the peers do not have (either alone where
    the other is not reported). Per GPU against its group, or per node against the group's other nodes.

    In a synchronous job such a GPU is slower than its peers whatever else it reads, so this counts as
    the cross-sectional "peers wait for it" evidence with no baseline needed; without it a brake present
    from the job's start is never named where SM activity is unsupported (a braked GPU draws *less* power
    than its spinning peers). Nothing is learned from such a GPU: an offset learned while braked (power far
    below the peers') made the recovered GPU stand out afterwards, an alert that never cleared.
    """
    deficit = -clk_dev >= cfg.straggler_clock_deficit
    # A driver without SM clocks leaves the bits alone (as in gpus.signals); one without throttle reasons,
    # the clock deficit alone.
    bits = (slow >= 0.5) & ~(peer_slow >= 0.25)
    return (bits & (deficit | np.isnan(clk_dev))) | (np.isnan(slow) & deficit)


def learning_rate(cfg, warming: np.ndarray) -> np.ndarray:
    """Offset learning rate per tick: fast while warming up (forgetting the ramp-up), then following
    slowly with the configured time constant."""
    return np.where(warming, _FAST_ALPHA, 1.0 - math.exp(-cfg.tick_seconds / cfg.offset_time_constant_seconds))


def follow(cur: np.ndarray, x: np.ndarray, learn: np.ndarray, alpha: np.ndarray | float) -> np.ndarray:
    """Exponential moving average step where learning and x is known; the first value is taken as is."""
    ok = learn & ~np.isnan(x)
    return np.where(ok, np.where(np.isnan(cur), x, cur + alpha * (x - cur)), cur)


def newest(tick: Tick, rows: np.ndarray) -> np.ndarray | None:
    """Each slot's newest reading of some binned rows, shape (len(rows), n): its newest bin's mean, or
    the bin before's where the newest has no sample (every other bin at 10 s sampling); None before
    the tick holds two bins."""
    if len(tick.held) < 2:
        return None
    recent = tick.windows.recent(tick.k, 2, rows, tick.held[:2])  # (2, rows, n), newest first
    return np.where(tick.held[0], recent[0], recent[1])
