"""grown: the one way engine state extends its per-slot, per-node and per-group arrays."""

from __future__ import annotations

import numpy as np

from gpufleet.server.engine.arrays import grown


def test_grown_pads_the_last_axis_with_the_fill_in_the_arrays_own_dtype():
    learned = np.array([[3, 4]], dtype=np.int64)
    out = grown(learned, 4, -1)
    assert out.dtype == np.int64 and out.tolist() == [[3, 4, -1, -1]]
    flags = grown(np.zeros(1, dtype=bool), 3, False)
    assert flags.dtype == bool and flags.tolist() == [False, False, False]


def test_grown_pads_a_middle_axis_and_keeps_what_was_there():
    ring = np.arange(2 * 1 * 3, dtype=np.float64).reshape(2, 1, 3)
    out = grown(ring, 2, np.nan, axis=1)
    assert out.shape == (2, 2, 3)
    assert np.array_equal(out[:, :1], ring) and np.isnan(out[:, 1]).all()


def test_grown_leaves_an_array_that_is_long_enough_as_it_is():
    spread = np.array([0.1, 0.2, 0.3])
    assert grown(spread, 2, np.nan) is spread
    assert grown(spread, 3, np.nan) is spread
