"""NaN-aware reductions for the per-tick hot path, with the exact values of the plain numpy calls.

A tick reduces a few thousand small rows (a GPU's last few bins, a group's few members), where numpy's
per-call and per-row costs dominate; these trade generality for fewer, larger calls.
"""

from __future__ import annotations

import numpy as np

# Up to this many values per reduction a sorting network of elementwise min/max beats np.sort, whose
# per-row cost dominates when each of thousands of rows holds a handful of values.
_NETWORK_MAX = 8
_BIG = np.finfo(np.float64).max


def nan_median_first_axis(x: np.ndarray) -> np.ndarray:
    """np.nanmedian(x, axis=0) without its warnings: NaN where every value is NaN."""
    s = x.shape[0]
    if s == 0:
        return np.full(x.shape[1:], np.nan)
    rows = sorted_nan_last(x.reshape(s, -1))
    med = (rows[(s - 1) // 2] + rows[s // 2]) / 2.0
    # NaN sorts last: a column whose last value is NaN has fewer than s values (a GPU that missed a
    # bin), and one whose first value is NaN has none (an unsupported reading: the NaN is right).
    partial = (np.isnan(rows[-1]) & ~np.isnan(rows[0])).nonzero()[0]
    if 4 * len(partial) > len(med):
        # Sampling slower than the tick leaves gaps in most columns: take every column by its count.
        med = _partial_medians(np.array(rows))
    elif len(partial):
        med[partial] = _partial_medians(np.array([r[partial] for r in rows]))
    return med.reshape(x.shape[1:])


def _partial_medians(srt: np.ndarray) -> np.ndarray:
    """Medians of the columns of srt (sorted along axis 0, NaN last), by each column's count."""
    s, m = srt.shape
    cnt = s - np.isnan(srt).sum(axis=0)
    cols = np.arange(m)
    flat = srt.ravel()
    # cnt // 2 < s always; with no values both positions are row 0, which is NaN then.
    lo = np.maximum(cnt - 1, 0) // 2 * m + cols
    hi = cnt // 2 * m + cols
    return (flat[lo] + flat[hi]) / 2.0


def sorted_nan_last(x: np.ndarray) -> list[np.ndarray]:
    """The rows of np.sort(x, axis=0) for a 2-d x (ascending, NaN last)."""
    s = x.shape[0]
    if s > _NETWORK_MAX:
        return list(np.sort(x, axis=0))
    rows = list(x)
    # Odd-even transposition sort: s rounds of compare-exchange between neighbours. fmin keeps the
    # number and maximum the NaN of a (number, NaN) pair, so NaN sinks to the end as in np.sort.
    for r in range(s):
        for i in range(r % 2, s - 1, 2):
            a, b = rows[i], rows[i + 1]
            rows[i], rows[i + 1] = np.fmin(a, b), np.maximum(a, b)
    return rows


def nan_mean_first_axis(x: np.ndarray) -> np.ndarray:
    """np.nanmean(x, axis=0) without its warnings, summing in axis order."""
    known = ~np.isnan(x)
    n = known.sum(axis=0)
    total = np.where(known, x, 0.0).sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return total / np.where(n > 0, n, np.nan)


def nan_to_zero(x: np.ndarray) -> np.ndarray:
    """np.nan_to_num(x) (NaN to 0, +-inf to the largest finite float) at a third of its call cost."""
    out = np.where(np.isnan(x), 0.0, x)
    np.maximum(out, -_BIG, out=out)
    return np.minimum(out, _BIG, out=out)


def median(x: np.ndarray) -> float:
    """np.median of a 1-d array without NaN (NaN when empty)."""
    n = len(x)
    if n == 0:
        return float("nan")
    srt = np.sort(x)
    return float((srt[(n - 1) // 2] + srt[n // 2]) / 2.0)


def equal(a: np.ndarray, b: np.ndarray) -> bool:
    """np.array_equal (same shape, every element equal) at half its call cost."""
    return a.shape == b.shape and bool((a == b).all())
