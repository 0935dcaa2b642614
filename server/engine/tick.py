"""One evaluation step's view of the windows: smoothed per-GPU readings and slot metadata."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from server.engine.config import EngineConfig
from server.engine.groups import GroupRegistry, Groups
from server.engine.windows import (B_CLOCK_RATIO, B_HW_THERMAL, B_POWER, B_POWER_CAP, B_SLOW, B_SM,
                                   B_TEMP, B_THERMAL, B_UTIL, Windows)

_MEDIAN_ROWS = (("util", B_UTIL), ("sm", B_SM), ("power", B_POWER), ("clock", B_CLOCK_RATIO),
                ("temp", B_TEMP))
_FRACTION_ROWS = (("thermal", B_THERMAL), ("hw_thermal", B_HW_THERMAL), ("slow", B_SLOW),
                  ("power_cap", B_POWER_CAP))


@dataclass(slots=True)
class Tick:
    """Everything detectors read at one closed bin."""

    k: int                          # bin number
    t: float                        # bin end, sample-time seconds: the time this evaluation speaks for
    config: EngineConfig
    windows: Windows
    latest: np.ndarray              # (N_BINNED, n) newest bin means
    med: dict[str, np.ndarray]      # smoothed (median / fraction over smooth window) per slot
    has_data: np.ndarray            # slot has a sample in the smoothing window
    groups: Groups
    registry: GroupRegistry
    slowdown: np.ndarray            # per group: peers' activity drop vs the group's baseline (NaN: unknown)
    slowdown_source: np.ndarray     # per group: 0 = none, 1 = SM activity, 2 = power
    slowdown_baselines: tuple[np.ndarray, np.ndarray]   # per group baseline SM activity, power


def smoothed(window: np.ndarray) -> dict[str, np.ndarray]:
    """Median over the window of the level readings, mean of the throttle-bit indicators."""
    rows = np.stack([window[b] for _, b in _MEDIAN_ROWS])          # (m, S, n)
    srt = np.sort(rows, axis=1)
    cnt = (~np.isnan(srt)).sum(axis=1)
    lo = np.clip((cnt - 1) // 2, 0, None)
    hi = np.clip(cnt // 2, 0, srt.shape[1] - 1)
    med = (np.take_along_axis(srt, lo[:, None, :], 1)[:, 0] + np.take_along_axis(srt, hi[:, None, :], 1)[:, 0]) / 2
    med[cnt == 0] = np.nan
    out = {name: med[i] for i, (name, _) in enumerate(_MEDIAN_ROWS)}
    with np.errstate(invalid="ignore", divide="ignore"):
        for name, b in _FRACTION_ROWS:
            x = window[b]
            n = (~np.isnan(x)).sum(axis=0)
            out[name] = np.where(n > 0, np.nansum(x, axis=0) / np.maximum(n, 1), np.nan)
    return out
