"""Read-only accessors over the engine's windows for the pages' charts: a few GPUs' bin means, not the fleet's.

Nothing here writes to the windows or feeds a detector; the runtime calls it on the engine's thread
between cycles, so it sees the bins the latest evaluation saw.
"""

from __future__ import annotations

import math

import numpy as np

from gpufleet.server.engine.windows import N_BINNED, ROW, Windows


def last_bin(tick_seconds: float, last_tick_time: float | None) -> int | None:
    """The bin the latest evaluation closed (it speaks for the bin's end), None before the first."""
    if last_tick_time is None:
        return None
    return math.floor(last_tick_time / tick_seconds + 0.5) - 1


def bin_means(w: Windows, last: int, n_bins: int, rows: tuple[str, ...], slots: np.ndarray) -> np.ndarray:
    """Means of `rows` in the bins last - n_bins + 1 .. last for `slots`, shape (n_bins, len(rows),
    len(slots)) oldest first; NaN where a GPU had no sample in a bin (or a reading it does not support)."""
    n_bins = min(n_bins, w.ring)
    slots = np.asarray(slots, dtype=np.int64)
    ks = last - np.arange(n_bins)[::-1]
    pos = (ks % w.ring)[:, None]
    held = w.bin_id[pos, slots[None, :]] == ks[:, None]  # (bins, slots)
    idx = np.array([ROW[r] for r in rows], dtype=np.int64)
    sums = w.acc[idx[None, :, None], pos[:, :, None], slots[None, None, :]]
    counts = w.acc[(idx + N_BINNED)[None, :, None], pos[:, :, None], slots[None, None, :]]
    with np.errstate(invalid="ignore", divide="ignore"):
        means = sums / counts
    return np.where(held[:, None, :], means, np.nan)


def job_slots(w: Windows, job: str) -> np.ndarray:
    """The GPUs the windows attribute to `job` now."""
    code = w.job_codes.get(job)
    if code is None:
        return np.empty(0, dtype=np.int64)
    return np.flatnonzero(w.slot_job[: w.n] == code)


def slot_of(w: Windows, node: str | None, gpu: int | None) -> int | None:
    """The slot of one GPU, None when the windows never saw it."""
    return w.slot_of.get((node, gpu))
