"""Replay's flushes, prepared many ticks at a time.

A flush pays numpy's per-call cost once per tick whatever it carries: resolving slots, differencing
counters, deriving readings and summing bins took a third to a half of replay's engine time on small
clusters. Replay knows every sample up front, so it promises the order in which they will come
(prepare_windows) and this module does that per-row work for a chunk of many ticks in one pass.

Each flush then applies only its own samples: jobs, sample and node times, counter events and bin cells.
What the engine reads after every flush is bit-for-bit what unprepared flushes leave (sums are taken
in the same order, from zero, as Windows._bin takes them); tests/server/test_engine_windows.py checks
that state after every flush. This module works on Windows' internals, as a part of it kept apart
because only replay needs it.
"""

from __future__ import annotations

from operator import is_
import numpy as np

from gpufleet.server.contract import NodeSample
from gpufleet.server.engine.windows import LIMIT_COLS, CounterEvent, Windows, scatter_cells

# About this many GPU rows are prepared at a time: enough to spread numpy's per-call cost over tens to
# hundreds of ticks of a small cluster, few enough to keep a chunk's arrays to a few megabytes.
PREPARED_CHUNK_ROWS = 8192


def prepare_windows(windows: Windows, samples: list[NodeSample]) -> None:
    """Replay's promise to `windows`: exactly these samples, sorted by time then node, will be add()ed in
    this order, each flush taking the next ones."""
    windows.prepare(Prepared(windows, samples))


class Prepared:
    """The promised samples, a cursor into them, and the chunk being applied."""

    def __init__(self, windows: Windows, samples: list[NodeSample]) -> None:
        times = np.fromiter((smp.time for smp in samples), dtype=np.float64, count=len(samples))
        steps = np.diff(times)
        ties = np.flatnonzero(steps == 0).tolist()
        if (steps < 0).any() or any(samples[i].node > samples[i + 1].node for i in ties):
            raise ValueError("prepared samples must be sorted by time, then node")
        self.w = windows
        self.samples = samples
        self.bins = bins = np.floor(times / windows.tick).astype(np.int64)
        # Where each run of samples in one bin ends (the last run ends the list).
        self.bin_runs = np.append(np.flatnonzero(bins[1:] != bins[:-1]) + 1, len(bins)).tolist()
        self.cursor = 0
        self.chunk: _Chunk | None = None

    def flush(self, inbox: list[NodeSample], min_bin: int) -> None:
        """Windows.flush() for prepared samples: the inbox must be the next of them, in order."""
        a = self.cursor
        b = a + len(inbox)
        if b > len(self.samples) or not all(map(is_, inbox, self.samples[a:b])):
            raise RuntimeError("flushed samples are not the next prepared ones")
        self.cursor = b
        resumed = None
        while a < b:
            chunk = self.chunk
            if chunk is None or not chunk.start <= a < chunk.end:
                chunk = self.chunk = self._chunk_of(a, self._chunk_end(a, b))
            end = min(b, chunk.end)
            first = self._apply(chunk, a, end, min_bin)
            if resumed is None:
                resumed = first
            a = end
        if resumed is not None:
            self.w.resumed_time = resumed

    def _chunk_end(self, start: int, flush_end: int) -> int:
        """Where a chunk from `start` ends: after whole bins, once PREPARED_CHUNK_ROWS rows are in.

        A snapshot past this flush (flush_end) that would register a GPU or a job, or move one, ends
        the chunk before its bin: resolving it now would show the engine GPUs and jobs that have not
        reported yet."""
        samples, runs = self.samples, self.bin_runs
        known = {node: (c.indices, c.uuids, c.jobs) for node, c in self.w._nodes.items()}
        rows, end, n = 0, start, len(samples)
        run = int(np.searchsorted(runs, start, side="right"))
        while end < n:
            nxt = runs[run]
            run += 1
            if end > start and rows >= PREPARED_CHUNK_ROWS:
                break
            changed = False
            for i in range(end, nxt):
                smp = samples[i]
                ident = known.get(smp.node)
                if (
                    ident is None
                    or ident[0] is not smp.indices
                    or ident[1] is not smp.uuids
                    or ident[2] is not smp.jobs
                ):
                    known[smp.node] = (smp.indices, smp.uuids, smp.jobs)
                    changed |= i >= flush_end
                rows += len(smp.indices)
            if changed:
                # Before its bin; where that bin began within this flush, at the flush's end (that bin's
                # rows then take _bin's path, see _apply).
                return max(end, flush_end)
            end = nxt
        return end

    def _chunk_of(self, start: int, end: int) -> _Chunk:
        """Resolve, difference, derive and sum into cells the samples start..end."""
        w = self.w
        chunk_samples = self.samples[start:end]
        resolved = list(map(w._resolve, chunk_samples))
        counts = np.fromiter((len(r[0]) for r in resolved), dtype=np.int64, count=len(resolved))
        chunk = _Chunk(
            start,
            end,
            np.concatenate([[0], np.cumsum(counts)]),
            np.array([smp.time for smp in chunk_samples]),
            np.array([w.node_ids.get(smp.node, -1) for smp in chunk_samples], dtype=np.int64),
        )
        if not chunk.row_start[-1]:
            return chunk
        # A snapshot that lists no GPU keeps its node's previous job codes: leave it out, as flush() does.
        listed = [(smp, r) for smp, r in zip(chunk_samples, resolved) if len(r[0])]
        nonempty = [smp for smp, _ in listed]
        chunk.slots = slots = np.concatenate([r[0] for _, r in listed])
        chunk.codes = np.concatenate([r[1] for _, r in listed])
        chunk.times = times = np.repeat(chunk.sample_time, counts)
        values = np.concatenate([smp.values for smp in nonempty])
        by_slot = np.argsort(slots, kind="stable")
        sorted_slots = slots[by_slot]
        one_per_slot = not (sorted_slots[1:] == sorted_slots[:-1]).any()
        # Every row follows its GPU's earlier ones (the samples are in time order). The counter events
        # are held back until the flush of their samples.
        outer, w.events = w.events, []
        power = w._counters(slots, times, values, np.ones(len(slots), dtype=bool), nonempty, by_slot, one_per_slot)
        chunk.events, w.events = w.events, outer
        chunk.derived = derived = w._derive(values, power)
        chunk.limits = values[:, LIMIT_COLS]
        self._cells(chunk, np.floor(times / w.tick).astype(np.int64), slots, derived)
        return chunk

    def _cells(self, chunk: _Chunk, bins: np.ndarray, slots: np.ndarray, derived: np.ndarray) -> None:
        """The chunk's (bin, slot) cells in bin order, each cell's rows summed in row order from zero
        as Windows._bin sums them, and where each cell sits in bin_id and acc."""
        w = self.w
        key = (bins - bins[0]) * w._cap + slots
        if (key[1:] > key[:-1]).all():
            # One row per cell, in cell order already (a tick's snapshots list GPUs in slot order).
            order = starts = np.arange(len(key))
            first_rows: slice | np.ndarray = slice(None)
            later = None
        else:
            order = np.argsort(key, kind="stable")
            sorted_key = key[order]
            first = np.ones(len(key), dtype=bool)
            first[1:] = sorted_key[1:] != sorted_key[:-1]
            starts = np.flatnonzero(first)
            first_rows = order[starts]
            # Snapshots come in time order, not slot order, and a few GPUs report twice within a bin
            # (sampling jitter): those later rows are added to their cell below.
            later = np.flatnonzero(~first) if len(starts) < len(key) else None
        # Each cell's first row is its sum so far: 0.0 + row, i.e. the row + 0.0 (which turns -0.0 into
        # 0.0, as a sum from zero does); NaN adds nothing and counts nothing.
        chunk.cell_sums = _sums_and_counts(derived[:, first_rows])
        if later is not None:
            # In row order: np.add.at applies repeated indices in turn, as a sum over the rows would.
            cells_of_later = np.cumsum(first)[later] - 1
            np.add.at(chunk.cell_sums.T, cells_of_later, _sums_and_counts(derived[:, order[later]]).T)
        chunk.cell_rows = np.diff(np.append(starts, len(key)))
        chunk.cell_bin = bins[order[starts]]
        # Slots are registered while the chunk is built, never after: the layout (_cap) holds until
        # the chunk is applied.
        chunk.cell_flat = (chunk.cell_bin % w.ring) * w._cap + slots[order[starts]]

    def _apply(self, chunk: _Chunk, a: int, e: int, min_bin: int) -> float | None:
        """Apply samples a..e (all within chunk) as a flush of them would; the time of the first that
        lists a GPU (None: none does)."""
        w = self.w
        i0, i1 = a - chunk.start, e - chunk.start
        r0, r1 = int(chunk.row_start[i0]), int(chunk.row_start[i1])
        if r0 == r1:
            return None  # snapshots that list no GPU
        listed = np.diff(chunk.row_start[i0 : i1 + 1]) > 0
        sample_times = chunk.sample_time[i0:i1][listed]
        node_ids = chunk.node_id[i0:i1][listed]
        w.samples += r1 - r0
        w.newest_time = max(w.newest_time, float(sample_times[-1]))
        w.node_last_time[node_ids] = np.fmax(w.node_last_time[node_ids], sample_times)
        slots, times = chunk.slots[r0:r1], chunk.times[r0:r1]
        w._update_jobs(slots, chunk.codes[r0:r1], times, times >= w.slot_last_time[slots])
        w.note_limits(slots, chunk.limits[r0:r1])
        if chunk.events:
            until = float(sample_times[-1])
            w.events.extend(ev for ev in chunk.events if ev.time <= until)
            chunk.events = [ev for ev in chunk.events if ev.time > until]
        bins = self.bins
        first_bin, last_bin = int(bins[a]), int(bins[e - 1])
        whole = (
            (a == 0 or bins[a - 1] < first_bin)
            and (e == len(bins) or bins[e] > last_bin)
            and last_bin - first_bin < w.ring
        )
        if whole:
            c0, c1 = np.searchsorted(chunk.cell_bin, [first_bin, last_bin + 1]).tolist()
            self._write_cells(chunk, c0, c1, min_bin)
        else:
            # A bin shared with another flush: its rows go through _bin like any flush's.
            ordered = np.sort(slots)
            w._bin(slots, times, chunk.derived[:, r0:r1], min_bin, not (ordered[1:] == ordered[:-1]).any())
        return float(sample_times[0])

    def _write_cells(self, chunk: _Chunk, c0: int, c1: int, min_bin: int) -> None:
        """Windows._bin's last step for the chunk's cells c0..c1, summed already."""
        w = self.w
        bins, flat = chunk.cell_bin[c0:c1], chunk.cell_flat[c0:c1]
        sums = chunk.cell_sums[:, c0:c1]
        bin_id = w.bin_id.reshape(-1)
        held = bin_id[flat]
        keep = bins >= np.maximum(held, min_bin)
        if not keep.all():
            w.late_dropped += int(chunk.cell_rows[c0:c1][~keep].sum())
            bins, flat, sums, held = bins[keep], flat[keep], sums[:, keep], held[keep]
        fresh = bins > held
        cells = w.cells()
        if fresh.all():
            # Every cell starts from zero (the usual case), and 0.0 + a sum that began at 0.0 is that sum.
            bin_id[flat] = bins
            scatter_cells(cells, flat, sums)
            return
        bin_id[flat[fresh]] = bins[fresh]
        scatter_cells(cells, flat, np.where(fresh, 0.0, cells[:, flat]) + sums)


def _sums_and_counts(rows: np.ndarray) -> np.ndarray:
    """Binned rows as a cell's sums (NaN as 0.0, plus 0.0) stacked over its counts (1.0 where not NaN)."""
    out = np.empty((2 * len(rows), rows.shape[1]))
    valid = ~np.isnan(rows)
    np.copyto(out[: len(rows)], 0.0)
    np.copyto(out[: len(rows)], rows, where=valid)
    out[: len(rows)] += 0.0
    out[len(rows) :] = valid
    return out


class _Chunk:
    """Prepared samples start..end: per-sample row offsets, times and node ids; per-row slots, job codes,
    times, derived readings and limits; counter events not yet released; and cells (bin, slot) in bin
    order."""

    __slots__ = (
        "start",
        "end",
        "row_start",
        "sample_time",
        "node_id",
        "slots",
        "codes",
        "times",
        "derived",
        "limits",
        "events",
        "cell_sums",
        "cell_rows",
        "cell_bin",
        "cell_flat",
    )
    # Set once the chunk has rows (_chunk_of); an empty chunk has none of them.
    slots: np.ndarray
    codes: np.ndarray
    times: np.ndarray
    derived: np.ndarray
    limits: np.ndarray
    cell_sums: np.ndarray
    cell_rows: np.ndarray
    cell_bin: np.ndarray
    cell_flat: np.ndarray

    def __init__(
        self, start: int, end: int, row_start: np.ndarray, sample_time: np.ndarray, node_id: np.ndarray
    ) -> None:
        self.start, self.end = start, end
        self.row_start, self.sample_time, self.node_id = row_start, sample_time, node_id
        self.events: list[CounterEvent] = []
