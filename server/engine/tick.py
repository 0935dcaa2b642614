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

_MEDIAN_INDEX = [b for _, b in _MEDIAN_ROWS]
_FRACTION_INDEX = [b for _, b in _FRACTION_ROWS]


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
    rows = window[_MEDIAN_INDEX]                                    # (m, S, n)
    cnt = (~np.isnan(rows)).sum(axis=1)
    srt = np.sort(rows, axis=1)
    lo = np.maximum((cnt - 1) // 2, 0)
    hi = np.minimum(cnt // 2, srt.shape[1] - 1)
    med = (np.take_along_axis(srt, lo[:, None, :], 1)[:, 0] + np.take_along_axis(srt, hi[:, None, :], 1)[:, 0]) / 2
    med[cnt == 0] = np.nan
    out = {name: med[i] for i, (name, _) in enumerate(_MEDIAN_ROWS)}
    # All indicator rows at once: a tick is a few hundred GPUs, so numpy's per-call cost dominates.
    x = window[_FRACTION_INDEX]                                     # (f, S, n)
    known = ~np.isnan(x)
    n = known.sum(axis=1)
    total = np.where(known, x, 0.0).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        frac = np.where(n > 0, total / np.maximum(n, 1), np.nan)
    for i, (name, _) in enumerate(_FRACTION_ROWS):
        out[name] = frac[i]
    return out

