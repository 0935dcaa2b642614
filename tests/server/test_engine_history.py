"""GroupHistory: a job's own baseline, median and noise from its healthy ticks."""

from __future__ import annotations

import numpy as np

from gpufleet.server.engine.groups import LEVELS, GroupHistory, Groups

RING, MIN_TICKS, LAG = 180, 24, 12


def _groups(power: float) -> Groups:
    levels = np.full((len(LEVELS), 1), np.nan)
    levels[LEVELS.index("power")] = power
    levels[LEVELS.index("util")] = 1.0
    levels[LEVELS.index("clock")] = 1.0
    return Groups(np.zeros(8, dtype=np.int64), np.full(8, -1), 1, np.array([8]), levels, np.zeros(1), np.zeros(1))


def _history(series: np.ndarray) -> GroupHistory:
    hist = GroupHistory(RING, 90.0, MIN_TICKS, LAG)
    for k, watts in enumerate(series):
        hist.record(k, _groups(float(watts)), np.array([True]))
    hist.refresh(len(series) - 1, 1)
    return hist


def test_noise_is_read_from_changes_so_a_trend_and_a_level_shift_do_not_count_as_noise():
    rng = np.random.default_rng(3)
    k = np.arange(RING)
    # 1 % noise on 300 W, a climb of 30 W over the window, and a 20 W step half way: the levels spread
    # four times wider than the noise. The climb still adds 2 W to each change a lag apart.
    series = 300.0 + 30.0 * k / RING + 20.0 * (k >= RING // 2) + rng.normal(0.0, 3.0, RING)
    hist = _history(series)
    assert np.std(series) > 12.0
    assert 2.4 < hist.spread("power")[0] < 4.0
    assert hist.median("power")[0] < hist.baseline("power")[0]
    assert np.isnan(hist.spread("sm")[0])  # SM activity not reported: no noise either


def test_noise_waits_for_three_lags_of_pairs_and_is_forgotten_with_the_history():
    rng = np.random.default_rng(4)
    series = 300.0 + rng.normal(0.0, 3.0, 3 * LAG + LAG - 1)  # one pair short of 3 × LAG
    hist = _history(series)
    assert hist.baseline("power")[0] > 0 and np.isnan(hist.spread("power")[0])
    hist = _history(np.append(series, 300.0))
    assert hist.spread("power")[0] > 0
    hist.reset(np.array([0]))
    assert np.isnan(hist.spread("power")[0]) and np.isnan(hist.median("power")[0])


def test_a_group_taking_over_a_history_has_its_baseline_noise_and_ring_at_once():
    rng = np.random.default_rng(5)
    hist = _history(300.0 + rng.normal(0.0, 3.0, RING))
    hist.inherit(1, 0)
    for name in ("power", "clock"):
        assert hist.baseline(name)[1] == hist.baseline(name)[0]
    assert hist.spread("power")[1] == hist.spread("power")[0]
    # The ring came too: the next refresh reads the same history for both.
    hist.refresh(RING - 1, 2)
    assert hist.baseline("power")[1] == hist.baseline("power")[0]
