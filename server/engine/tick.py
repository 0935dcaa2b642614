"""One evaluation step's view of the windows: smoothed per-GPU readings and slot metadata."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from gpufleet.server.engine.config import EngineConfig
from gpufleet.server.engine.groups import LEVELS, GroupRegistry, Groups
from gpufleet.server.engine.reduce import nan_mean_first_axis, nan_median_first_axis
from gpufleet.server.engine.windows import (
    B_CLOCK_RATIO,
    B_HW_THERMAL,
    B_POWER,
    B_POWER_CAP,
    B_SLOW,
    B_SM,
    B_THERMAL,
    B_UTIL,
    Windows,
)

# Only what detectors read every tick is smoothed; the temperature median is needed just for the
# evidence of a thermal finding and is taken on demand (smoothed_row).
_LEVEL_ROWS = dict(zip(LEVELS, (B_SM, B_POWER, B_CLOCK_RATIO, B_UTIL)))
_FRACTION_ROWS = (("slow", B_SLOW), ("power_cap", B_POWER_CAP))
_ROWS = np.array([_LEVEL_ROWS[name] for name in LEVELS] + [b for _, b in _FRACTION_ROWS])


class SlowdownSource(IntEnum):
    """Which reading a group's slowdown is measured on (the values are what Tick.slowdown_source holds)."""

    NONE = 0  # no reading to measure it on: the slowdown is unknown
    SM_ACTIVITY = 1  # SM activity against its baseline
    POWER = 2  # power against its baseline, where SM activity is unsupported and clocks hold


@dataclass(slots=True, kw_only=True)
class Tick:
    """Everything detectors read at one closed bin."""

    k: int  # bin number
    t: float  # bin end, sample-time seconds: the time this evaluation speaks for
    config: EngineConfig
    windows: Windows
    latest: np.ndarray  # (N_BINNED, n) newest bin means
    med: dict[str, np.ndarray]  # smoothed (median / fraction over smooth window) per slot
    levels: np.ndarray  # (4, n) the medians among med, rows as groups.LEVELS
    has_data: np.ndarray  # slot has a sample in the smoothing window
    groups: Groups
    registry: GroupRegistry
    slowdown: np.ndarray  # per group: peers' activity drop vs the group's baseline (NaN: unknown)
    slowdown_source: np.ndarray  # per group: a SlowdownSource value
    slowdown_baselines: tuple[np.ndarray, np.ndarray]  # per group baseline SM activity, power
    held: np.ndarray  # (bins, n) newest first: slot has a sample in bin k - i
    sag: np.ndarray  # per group: the same series' drop below its history's median (see
    # workload.sag; the slowdown until the median is known)

    def seen(self, n_bins: int) -> np.ndarray:
        """Per slot: whether any sample fell into the last n_bins bins."""
        if n_bins <= len(self.held):
            return np.asarray(self.held[:n_bins].any(axis=0))
        return self.windows.has_data(self.k, n_bins)


def read_windows(w: Windows, k: int, n_bins: int, held: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Newest bin of every binned row; medians over the last n_bins bins of the levels (4, n, rows as
    groups.LEVELS); mean share of the throttle indicators (slow, power_cap) over the same bins.

    `held` is w.held(k, m) for some m >= n_bins (the engine reads it once for several look-backs).
    """
    latest = w.latest(k, held[0])
    window = w.recent(k, n_bins, _ROWS, held[:n_bins])  # (bins, rows, n)
    n_levels = len(LEVELS)
    return latest, nan_median_first_axis(window[:, :n_levels]), nan_mean_first_axis(window[:, n_levels:])


def newest_levels(tick: Tick) -> np.ndarray:
    """(4, n) the newest bin's readings, rows as groups.LEVELS: what a condition reads before smoothing."""
    return tick.latest[_ROWS[: len(LEVELS)]]


def smoothed(levels: np.ndarray, fractions: np.ndarray) -> dict[str, np.ndarray]:
    """The smoothed readings by name (views of the arrays read_windows returns)."""
    out = dict(zip(LEVELS, levels))
    out.update(zip((name for name, _ in _FRACTION_ROWS), fractions))
    return out


def smoothed_row(tick: Tick, row: int, slots: np.ndarray) -> np.ndarray:
    """Median of one binned row over the smoothing window for some slots (rarely needed readings)."""
    n_bins = tick.config.bins(tick.config.smooth_seconds)
    held = tick.held[:n_bins] if len(tick.held) >= n_bins else None
    return nan_median_first_axis(tick.windows.recent(tick.k, n_bins, [row], held, slots)[:, 0])


# What slows a GPU's clocks, from the shares of the smoothing window's samples with each kind of bit:
# the throttle indicators the windows keep tell heat (SW 0x20, HW 0x40) from HW slowdown or power brake
# (0x08, 0x80: the board's power delivery, or a power draw too high) and the power cap (0x04).
_SHARE_ROWS = [B_HW_THERMAL, B_THERMAL, B_SLOW, B_POWER_CAP]
THROTTLE_CAUSES = {
    "hw_thermal_slowdown": "HW thermal slowdown (heat)",
    "sw_thermal_slowdown": "SW thermal slowdown (heat)",
    "hw_slowdown_or_power_brake": "HW slowdown or power brake, not heat (power delivery, or power draw too high)",
    "sw_power_cap": "SW power cap",
}


def throttle_causes(tick: Tick, slots: np.ndarray) -> list[str]:
    """The throttle causes (keys of THROTTLE_CAUSES) present in at least half of the smoothing window's
    samples of these slots, taken together; for the wording of a finding, never for deciding one."""
    n_bins = tick.config.bins(tick.config.smooth_seconds)
    held = tick.held[:n_bins] if len(tick.held) >= n_bins else None
    shares = nan_mean_first_axis(
        tick.windows.recent(tick.k, n_bins, _SHARE_ROWS, held, slots).transpose(0, 2, 1).reshape(-1, len(_SHARE_ROWS))
    )
    hw_thermal, thermal, slow, power_cap = shares.tolist()
    # Heat's bits are among the slowdown bits, so the samples slowed by anything else are the difference.
    hits = (hw_thermal >= 0.5, thermal >= 0.5 and not hw_thermal >= 0.5, slow - thermal >= 0.5, power_cap >= 0.5)
    return [cause for cause, hit in zip(THROTTLE_CAUSES, hits) if hit]
