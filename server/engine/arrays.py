"""Per-slot, per-node and per-group arrays that grow as GPUs, nodes and groups appear."""

from __future__ import annotations

import numpy as np


def grown(arr: np.ndarray, n: int, fill: float | int | bool, axis: int = -1) -> np.ndarray:
    """`arr` with `axis` extended to at least n entries, the new ones set to `fill` in arr's dtype; arr
    itself when it is long enough already."""
    have = arr.shape[axis]
    if n <= have:
        return arr
    shape = list(arr.shape)
    shape[axis] = n - have
    return np.concatenate([arr, np.full(shape, fill, dtype=arr.dtype)], axis=axis)
