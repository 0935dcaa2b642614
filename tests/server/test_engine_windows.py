"""Windows: binning, counters (resets, late samples), energy-derived power."""

from __future__ import annotations

import numpy as np
import pytest

from gpufleet.server.contract import parse_lines
from gpufleet.server.engine import prepared as prepared_module
from gpufleet.server.engine.windows import (
    B_POWER,
    B_THERMAL,
    B_UTIL,
    L_MEM_MAX,
    L_SLOWDOWN,
    N_BINNED,
    Windows,
    scatter_cells,
)
from tests.server.engine_samples import T0, healthy, sample, snapshot_line


def _w() -> Windows:
    return Windows(5.0, 12)


def test_samples_in_one_bin_are_averaged_and_bits_become_fractions():
    w = _w()
    for i, (u, bits) in enumerate([(0.2, 0), (0.4, 0x20), (0.6, 0x20)]):
        w.add(sample("n0", T0 + i, [healthy(0, utilization_ratio=u, throttle_reasons=bits)]))
    w.flush(min_bin=0)
    k = int(T0 // 5)
    win = w.window(k, 2)
    assert win[B_UTIL, 0, 0] == np.float64(0.4).item() or abs(win[B_UTIL, 0, 0] - 0.4) < 1e-12
    assert abs(win[B_THERMAL, 0, 0] - 2 / 3) < 1e-12
    assert np.isnan(win[B_UTIL, 1, 0])  # previous bin: no data


def test_a_mask_with_nvmls_unknown_reason_bit_63_is_read_without_an_invalid_cast():
    w = _w()
    with np.errstate(all="raise"):
        for i, bits in enumerate([2**63, 2**63 + 2**62, 0x20 | 0x40]):
            w.add(sample("n0", T0 + i, [healthy(0, throttle_reasons=bits)]))
        w.flush(min_bin=0)
    # Bit 63 alone says nothing of the thermal bits (a float has lost a 64-bit value's low bits anyway).
    assert abs(w.window(int(T0 // 5), 1)[B_THERMAL, 0, 0] - 1 / 3) < 1e-12


def test_each_gpu_keeps_its_newest_reported_limits_and_a_limit_never_reported_stays_unknown():
    w = _w()
    w.add(sample("n0", T0, [healthy(0, memory_max_operating_temperature_celsius=95.0), healthy(1)]))
    w.add(
        sample(
            "n0",
            T0 + 1,
            [healthy(0, slowdown_temperature_celsius=None, memory_max_operating_temperature_celsius=None), healthy(1)],
        )
    )
    w.flush(min_bin=0)
    w.add(sample("n0", T0 + 6, [healthy(0, slowdown_temperature_celsius=86.0), healthy(1)]))
    w.flush(min_bin=0)
    # A sample without a limit leaves the one reported before; a newer report replaces it.
    assert w.slot_limits[L_MEM_MAX, :2].tolist()[0] == 95.0 and np.isnan(w.slot_limits[L_MEM_MAX, 1])
    assert w.slot_limits[L_SLOWDOWN, :2].tolist() == [86.0, 87.0]


def test_ingest_order_and_chunking_do_not_change_the_bins():
    samples = [sample(f"n{n}", T0 + t, [healthy(0, power_watts=100.0 + t + n)]) for t in range(0, 20) for n in range(2)]
    a, b = _w(), _w()
    for s in samples:
        a.add(s)
    a.flush(0)
    for s in reversed(samples[::2]):
        b.add(s)
    b.flush(0)
    for s in samples[1::2]:
        b.add(s)
    b.flush(0)
    k = int((T0 + 19) // 5)
    assert np.allclose(a.window(k, 4), b.window(k, 4), equal_nan=True)


def test_power_comes_from_energy_when_power_is_unsupported_and_resets_are_skipped():
    w = _w()
    energy = [0.0, 1000.0, 2000.0, 50.0, 1050.0]  # reset between the 3rd and 4th sample
    for i, e in enumerate(energy):
        w.add(sample("n0", T0 + 5 * i, [healthy(0, power_watts=None, energy_joules_total=e)]))
    w.flush(0)
    k0 = int(T0 // 5)
    powers = [w.window(k0 + i, 1)[B_POWER, 0, 0] for i in range(5)]
    assert np.isnan(powers[0])
    assert powers[1] == 200.0 and powers[2] == 200.0
    assert np.isnan(powers[3])  # went backwards: no rate
    assert powers[4] == 200.0


def test_xid_counter_reset_is_not_an_event_but_new_errors_after_it_are():
    w = _w()
    for i, (total, last) in enumerate([(3, 13), (0, None), (1, 43)]):
        w.add(sample("n0", T0 + 5 * i, [healthy(0, xid_errors_total=total, last_xid=last)]))
    w.flush(0)
    events = w.drain_events()
    assert [(e.kind, e.delta, e.codes) for e in events] == [("xid", 1, (43,))]


def test_samples_older_than_the_ring_are_dropped_and_counted():
    w = _w()
    w.add(sample("n0", T0 + 100, [healthy(0)]))
    w.flush(0)
    w.add(sample("n0", T0, [healthy(0)]))
    w.flush(min_bin=int((T0 + 100) // 5) - 11)
    # Dropped whole, before it could touch the GPU's counters, job or times.
    assert (w.too_old_dropped, w.late_dropped, w.samples) == (1, 0, 1)
    assert w.slot_last_time[0] == T0 + 100


def test_job_change_restarts_the_gpu_job_clock():
    w = _w()
    w.add(sample("n0", T0, [healthy(0, job="a")]))
    w.add(sample("n0", T0 + 50, [healthy(0, job="b")]))
    w.flush(0)
    assert w.job_names[w.slot_job[0]] == "b" and w.slot_job_since[0] == T0 + 50


def test_one_sample_per_gpu_batches_bin_like_sub_tick_batches():
    # One sample per GPU per flush takes the direct scatter; several per GPU take the merging path.
    # Both must leave the same bins, including when a later flush adds to a bin already holding data.
    samples = [
        sample("n0", T0 + t, [healthy(g, utilization_ratio=0.1 * g + 0.01 * t) for g in range(3)]) for t in range(10)
    ]
    one, many = _w(), _w()
    for s in samples:
        one.add(s)
        one.flush(0)
    for pair in (samples[:4], samples[4:]):
        for s in pair:
            many.add(s)
        many.flush(0)
    k = int((T0 + 9) // 5)
    np.testing.assert_allclose(one.window(k, 3), many.window(k, 3), rtol=1e-12, equal_nan=True)
    assert one.samples == many.samples == 30


def test_latest_recent_and_held_agree_with_window():
    w = _w()
    for t in (0, 1, 12, 13, 30):  # bins 0, 2 and 6 of GPU 0; GPU 1 only at 30
        w.add(sample("n0", T0 + t, [healthy(0, utilization_ratio=0.01 * t)] + ([healthy(1)] if t == 30 else [])))
    w.flush(0)
    k = int((T0 + 30) // 5)
    full = w.window(k, 7)  # (rows, bins, n)
    held = w.held(k, 7)
    np.testing.assert_array_equal(held, ~np.isnan(full[B_UTIL]))
    np.testing.assert_array_equal(w.has_data(k, 3), held[:3].any(axis=0))
    np.testing.assert_array_equal(w.latest(k, held[0]), full[:, 0])
    rows = np.array([B_POWER, B_UTIL])
    np.testing.assert_array_equal(w.recent(k, 7, rows, held), full[rows].transpose(1, 0, 2))
    assert w.latest(k, held[0]).shape == (N_BINNED, 2)


def _messy_trace() -> list:
    """Parsed like replay parses (identity tuples shared per node), sorted by time then node: n0 every
    second, n1 every 5 s, n2 joining after 40 s, a job change on n0, an energy counter reset, new XIDs, a
    snapshot that lists no GPU, and a GPU that drops out of n1's list and comes back; n3 every 5 s, its
    GPUs listed in reverse order from 50 s, and alone after 90 s (one row per cell, out of slot order)."""
    lines = [
        snapshot_line(
            "n3",
            T0 + t + 0.75,
            [healthy(g, power_watts=250.0 + t + g) for g in (range(3) if t < 50 else range(2, -1, -1))],
        )
        for t in range(0, 140, 5)
    ]
    for t in range(90):
        if t == 60:
            lines.append(snapshot_line("n0", T0 + t + 0.5, []))
        lines.append(
            snapshot_line(
                "n0",
                T0 + t,
                [
                    healthy(
                        g,
                        job="a" if t < 33 else "b",
                        utilization_ratio=0.5 + 0.005 * t + 0.01 * g,
                        energy_joules_total=(t if t < 50 else t - 50) * 400.0 + g,
                        xid_errors_total=int(t >= 70),
                        last_xid=79 if t >= 70 else None,
                    )
                    for g in range(2)
                ],
            )
        )
        if t % 5 == 2:
            lines.append(
                snapshot_line(
                    "n1",
                    T0 + t,
                    [
                        healthy(g, power_watts=300.0 + t, sm_active_ratio=None if g else 0.4 + 0.001 * t)
                        for g in range(3)
                        if not (g == 1 and 20 <= t < 45)
                    ],
                )
            )
        if t >= 40:
            lines.append(snapshot_line("n2", T0 + t + 0.25, [healthy(0, job=None, temperature_celsius=80.0 + 0.1 * t)]))
    samples = [s for _, s in parse_lines(lines)]
    return sorted(samples, key=lambda s: (s.time, s.node))


def _state(w: Windows) -> tuple:
    """Everything a flush leaves behind that the engine reads."""
    n = w.n
    return (
        n,
        list(w.slot_node),
        list(w.slot_uuid),
        list(w.job_names),
        w.samples,
        w.late_dropped,
        w.newest_time,
        w.resumed_time,
        w.node_last_time.tobytes(),
        w.slot_job[:n].tobytes(),
        w.slot_job_since[:n].tobytes(),
        w.slot_last_time[:n].tobytes(),
        w.bin_id.tobytes(),
        w.acc.tobytes(),
        w.slot_limits[:, :n].tobytes(),
        [(e.slot, e.time, e.kind, e.delta, e.codes) for e in w.drain_events()],
    )


@pytest.mark.parametrize("chunk_rows", [7, 40, 100_000])
def test_prepared_flushes_leave_exactly_what_unprepared_ones_do(monkeypatch, chunk_rows):
    # Chunks of about a bin (flushes span chunks), of a few bins, and of the whole trace (where only
    # GPUs and jobs yet to report end chunks); flushes at tick boundaries (replay's) and inside bins
    # (a bin split between two flushes takes _bin's path).
    monkeypatch.setattr(prepared_module, "PREPARED_CHUNK_ROWS", chunk_rows)
    samples = _messy_trace()
    for cuts in ([T0 + 5 * i for i in range(1, 29)], [T0 + 2.5 + 7 * i for i in range(20)]):
        plain, prepared = _w(), _w()
        prepared_module.prepare_windows(prepared, samples)
        pending = list(samples)
        for cut in cuts + [np.inf]:
            batch = [s for s in pending if s.time < cut]
            pending = pending[len(batch) :]
            for w in (plain, prepared):
                for s in batch:
                    w.add(s)
                w.flush(min_bin=int(min(cut, T0 + 140) // 5) - 11)
            assert _state(prepared) == _state(plain), cut
        assert prepared.n == 9 and prepared.samples == plain.samples


def test_prepared_windows_refuse_samples_out_of_order_or_not_the_prepared_ones():
    samples = _messy_trace()
    w = _w()
    with pytest.raises(ValueError, match="sorted"):
        prepared_module.prepare_windows(w, samples[::-1])
    prepared_module.prepare_windows(w, samples)
    w.add(samples[1])
    with pytest.raises(RuntimeError, match="prepared"):
        w.flush(0)


@pytest.mark.parametrize(
    "cell",
    [
        np.arange(40, 72),  # one run: a bin's every GPU in slot order
        np.delete(np.arange(40, 72), [3, 4, 20]),  # a few GPUs missing
        np.arange(0, 64, 2),  # more runs than are copied run by run
        np.array([9, 3, 4, 5, 60]),  # not in order
        np.array([7]),
    ],
)
def test_scattering_cells_run_by_run_writes_what_an_index_array_writes(cell):
    rng = np.random.default_rng(3)
    before = rng.random((4, 80))
    values = rng.random((4, len(cell)))
    expected = before.copy()
    expected[:, cell] = values
    got = before.copy()
    scatter_cells(got, cell, values)
    assert np.array_equal(got, expected)
