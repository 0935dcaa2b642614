"""Hot-path reductions: the same values as the plain numpy calls they replace, NaN handling included."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from gpufleet.server.engine.reduce import (
    equal,
    median,
    nan_mean_first_axis,
    nan_median_first_axis,
    nan_to_zero,
    sorted_nan_last,
)


def _windows(rng: np.random.Generator, bins: int, nan_share: float) -> np.ndarray:
    """Random (bins, 3, 40) windows with ties, gaps, and some all-NaN columns (unsupported readings)."""
    x = rng.random((bins, 3, 40)).round(2)
    x[rng.random(x.shape) < nan_share] = np.nan
    x[:, 0, :5] = np.nan
    return x


@pytest.mark.parametrize("bins", [1, 2, 5, 6, 8, 9, 12])  # both sides of the sorting-network limit
@pytest.mark.parametrize("nan_share", [0.0, 0.05, 0.5])  # full, a few partial, mostly partial
def test_nan_median_matches_numpy(bins, nan_share):
    x = _windows(np.random.default_rng(bins), bins, nan_share)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy warns on all-NaN columns
        expected = np.nanmedian(x, axis=0)
    np.testing.assert_array_equal(nan_median_first_axis(x), expected)


def test_nan_median_of_no_values_is_nan():
    assert np.isnan(nan_median_first_axis(np.empty((0, 3)))).all()


@pytest.mark.parametrize("bins", [1, 4, 7, 10])
def test_sorted_nan_last_matches_np_sort(bins):
    x = _windows(np.random.default_rng(10 + bins), bins, 0.3).reshape(bins, -1)
    np.testing.assert_array_equal(np.array(sorted_nan_last(x)), np.sort(x, axis=0))


def test_nan_mean_matches_summing_in_axis_order():
    x = _windows(np.random.default_rng(3), 6, 0.3)
    known = ~np.isnan(x)
    n = known.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        expected = np.where(n > 0, np.where(known, x, 0.0).sum(axis=0) / np.maximum(n, 1), np.nan)
    np.testing.assert_array_equal(nan_mean_first_axis(x), expected)


def test_nan_to_zero_matches_nan_to_num():
    x = np.array([[np.nan, np.inf, -np.inf], [-0.0, 1.5, -2.0]])
    out = nan_to_zero(x)
    np.testing.assert_array_equal(out, np.nan_to_num(x))
    assert np.isnan(x[0, 0])  # input untouched


def test_median_matches_numpy_for_odd_even_and_empty():
    rng = np.random.default_rng(7)
    for size in (1, 2, 7, 8):
        x = rng.random(size).round(1)
        assert median(x) == np.median(x)
    assert np.isnan(median(np.empty(0)))


def test_equal_is_array_equal():
    a = np.array([1, 2, 3])
    assert equal(a, a.copy()) and not equal(a, a[:2]) and not equal(a, np.array([1, 2, 4]))
    assert not equal(np.array([np.nan]), np.array([np.nan]))  # as np.array_equal: NaN != NaN
