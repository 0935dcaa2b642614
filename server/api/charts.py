"""Inline SVG pictures for the pages: a subject against its peers over time, a job's last hour, the fleet now.

Server-rendered strings with no script and no external asset (the pages work air-gapped). Each picture
is an `<svg role=img>` with a title and a description a screen reader reads, a legend, and axes that
name their unit; times are the server's local time, the zone named on the axis. Absent readings (NaN)
break a line instead of drawing it to zero; a picture with nothing to draw is a "no data" note.
"""

from __future__ import annotations

import math
from datetime import datetime, tzinfo
from html import escape
from itertools import count
from typing import Sequence

from gpufleet.server.history import FleetCell, Series

# Reading name -> (what a person calls it, unit on the axis, digits shown)
READINGS = {
    "sm_active_ratio": ("SM activity", "ratio 0-1", 2),
    "utilization_ratio": ("utilization", "ratio 0-1", 2),
    "power_watts": ("power", "W", 0),
    "temperature_celsius": ("temperature", "°C", 0),
}
SUBJECT_COLOUR = "#c2410c"
MEDIAN_COLOUR = "#1f4e79"
BAND_COLOUR = "#9ec5e8"
GRID_COLOUR = "#e3e6ea"
MARK_COLOUR = "#66707a"
NO_DATA_COLOUR = "#d0d4d9"
# (upper bound, colour, legend) from cool to hot; the last bound is open.
TEMPERATURE_STEPS = (
    (50.0, "#2c7bb6", "below 50 °C"),
    (65.0, "#abd9e9", "50-65 °C"),
    (75.0, "#fff3b0", "65-75 °C"),
    (85.0, "#fdae61", "75-85 °C"),
    (math.inf, "#d7191c", "85 °C and above"),
)
RELATIVE_STEPS = (
    (0.80, "#2166ac", "below 0.80 × its job's median"),
    (0.95, "#92c5de", "0.80-0.95 ×"),
    (1.05, "#f7f7f7", "0.95-1.05 × (with its job)"),
    (1.20, "#f4a582", "1.05-1.20 ×"),
    (math.inf, "#b2182b", "1.20 × and above"),
)
TIME_STEPS_SECONDS = (5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 86400)
GRID_STYLE = ".cell{stroke:#8a939c;stroke-width:.5}.out{stroke:#1d2329;stroke-width:2}"
_ids = count()


def reading_label(reading: str) -> tuple[str, str, int]:
    """(name, unit, digits) of a reading; an unknown one is named as it is spelt."""
    return READINGS.get(reading, (reading.replace("_", " "), "", 2))


def time_chart(
    s: Series,
    *,
    subject: str | None,
    marks: Sequence[tuple[float, str]] = (),
    tz: tzinfo | None = None,
    width: int = 600,
    height: int = 230,
) -> str:
    """A reading of `subject` (a line) against its peers' median (dashed) and band (shaded) over time."""
    name, unit, digits = reading_label(s.reading)
    values = [v for col in (s.subject, s.median, s.low, s.high) for v in col if _ok(v)]
    title = f"{name} of {subject} against its {s.peers} peers" if subject else f"{name} of its {s.peers} GPUs"
    if not values or not s.times:
        return _no_data(f"{title}: no data")
    box = _Box(width, height, 56, 14, 30, 40, min(s.times), max(s.times), *_y_range(s.reading, values))
    uid = f"c{next(_ids)}"
    peers = "peers'" if subject else "GPUs'"
    legend = []
    if subject:
        legend.append((SUBJECT_COLOUR, "line", subject))
    legend += [(MEDIAN_COLOUR, "dash", f"{peers} median"), (BAND_COLOUR, "band", f"{peers} {s.band}")]
    parts = [
        _open(uid, width, height, title, _describe(s, subject, name, unit, digits, tz)),
        _y_axis(box, name, unit, digits),
        _x_axis(box, tz),
        *(_band(box, s.times, s.low, s.high)),
        *(_line(box, s.times, s.median, MEDIAN_COLOUR, 1.5, "5 3", "median")),
        *(_line(box, s.times, s.subject, SUBJECT_COLOUR, 2.5, None, "subject") if subject else ()),
        *(_mark(box, t, label) for t, label in marks if box.x0 <= t <= box.x1),
        _legend(box, legend),
        "</svg>",
    ]
    return "".join(parts)


def job_chart(s: Series, *, job: str, tz: tzinfo | None = None, width: int = 300, height: int = 90) -> str:
    """A job's SM activity over the last hour: its GPUs' median and 25th-75th percentile, small."""
    values = [v for col in (s.median, s.low, s.high) for v in col if _ok(v)]
    title = f"job {job}: SM activity over the last hour"
    if not values or not s.times:
        return _no_data(f"{title}: no data yet", small=True)
    x0 = max(s.times) - 3600.0
    box = _Box(width, height, 30, 8, 8, 22, min(x0, min(s.times)), max(s.times), 0.0, max(1.0, max(values)))
    uid = f"j{next(_ids)}"
    desc = _describe(s, None, "SM activity", "ratio 0-1", 2, tz)
    return "".join(
        [
            _open(uid, width, height, title, desc),
            _y_axis(box, "", "", 1, ticks=(0.0, 0.5, 1.0)),
            _x_axis(box, tz, n=3, caption=False),
            *_band(box, s.times, s.low, s.high),
            *_line(box, s.times, s.median, MEDIAN_COLOUR, 1.5, None, "median"),
            "</svg>",
        ]
    )


def fleet_grid(cells: Sequence[FleetCell], *, colour_by: str, per_node: bool) -> str:
    """The fleet now, one square per GPU (a row per node) or per node, coloured by temperature
    (colour_by "temperature") or by SM activity over its job's median ("relative")."""
    steps = TEMPERATURE_STEPS if colour_by == "temperature" else RELATIVE_STEPS
    what = "temperature" if colour_by == "temperature" else "SM activity relative to its job's median"
    if not cells:
        return _no_data(f"GPUs by {what}: no data")
    size, gap, label_w = 16, 3, 0 if per_node else 96
    rows = _grid_rows(cells, per_node)
    cols = max(len(r) for _, r in rows)
    width = max(label_w + cols * (size + gap) + 8, 360)
    legend_y = len(rows) * (size + gap) + 12
    height = legend_y + 18 * (len(steps) + 1) + 4
    uid = f"g{next(_ids)}"
    unit = "hottest GPU of each node" if per_node else "one square per GPU"
    title = f"GPUs by {what} ({unit})"
    desc = _grid_desc(cells, colour_by, steps)
    # The outline in a style of the picture's own, not on each of up to a few thousand squares.
    out = [_open(uid, width, height, title, desc), f"<style>{GRID_STYLE}</style>"]
    for r, (node, row) in enumerate(rows):
        y = r * (size + gap)
        if not per_node:
            out.append(
                f'<text x="{label_w - 6}" y="{y + size - 4}" text-anchor="end" class="lbl">{escape(node)}</text>'
            )
        for c, cell in enumerate(row):
            value = cell.temperature_celsius if colour_by == "temperature" else cell.sm_vs_job_ratio
            colour, extreme = _step(value, steps)
            kind = "cell out" if extreme else "cell"
            out.append(
                f'<rect x="{label_w + c * (size + gap)}" y="{y}" width="{size}" height="{size}" fill="{colour}"'
                f' class="{kind}"><title>{escape(_cell_words(cell))}</title></rect>'
            )
    absent = "no data" if colour_by == "temperature" else "no data, or no job"
    legend = [(colour, "box", text) for _, colour, text in steps] + [(NO_DATA_COLOUR, "box", absent)]
    for i, (colour, _, text) in enumerate(legend):
        y = legend_y + i * 18
        out.append(
            f'<rect x="{label_w}" y="{y}" width="12" height="12" fill="{colour}" stroke="#8a939c"/>'
            f'<text x="{label_w + 18}" y="{y + 10}" class="lbl">{escape(text)}</text>'
        )
    out.append("</svg>")
    return "".join(out)


# -- building blocks ---------------------------------------------------------------------------


class _Box:
    """The plot area inside an SVG and the data ranges it maps."""

    def __init__(
        self,
        width: int,
        height: int,
        left: int,
        right: int,
        top: int,
        bottom: int,
        x0: float,
        x1: float,
        y0: float,
        y1: float,
    ) -> None:
        self.width, self.height = width, height
        self.left, self.right, self.top, self.bottom = left, width - right, top, height - bottom
        self.x0, self.x1 = x0, x1 if x1 > x0 else x0 + 1.0
        self.y0, self.y1 = y0, y1 if y1 > y0 else y0 + 1.0

    def x(self, t: float) -> float:
        return self.left + (t - self.x0) / (self.x1 - self.x0) * (self.right - self.left)

    def y(self, v: float) -> float:
        return self.bottom - (v - self.y0) / (self.y1 - self.y0) * (self.bottom - self.top)


def _ok(v: float | None) -> bool:
    return v is not None and not math.isnan(v) and not math.isinf(v)


def _y_range(reading: str, values: list[float]) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    if reading.endswith("_ratio"):
        return 0.0, max(1.0, hi)
    pad = max((hi - lo) * 0.1, 1.0)
    return max(0.0, lo - pad) if lo >= 0 else lo - pad, hi + pad


def _open(uid: str, width: int, height: int, title: str, desc: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" role="img" width="{width}" height="{height}"'
        f' viewBox="0 0 {width} {height}" aria-labelledby="{uid}-t {uid}-d">'
        f'<title id="{uid}-t">{escape(title)}</title><desc id="{uid}-d">{escape(desc)}</desc>'
    )


def _no_data(text: str, small: bool = False) -> str:
    return (
        f'<p class="muted nodata" role="note">{escape(text)}</p>'
        if not small
        else f'<span class="muted nodata">{escape(text)}</span>'
    )


def _segments(box: _Box, times: Sequence[float], values: Sequence[float]) -> list[list[tuple[float, float]]]:
    """Runs of consecutive present values as plot points: an absent reading breaks the line."""
    runs: list[list[tuple[float, float]]] = [[]]
    for t, v in zip(times, values):
        if _ok(v):
            runs[-1].append((box.x(t), box.y(v)))
        elif runs[-1]:
            runs.append([])
    return [r for r in runs if r]


def _points(run: Sequence[tuple[float, float]]) -> str:
    return " ".join(f"{x:.1f},{y:.1f}" for x, y in run)


def _line(box: _Box, times, values, colour: str, width: float, dash: str | None, role: str) -> list[str]:
    dashed = f' stroke-dasharray="{dash}"' if dash else ""
    out = []
    for run in _segments(box, times, values):
        if len(run) == 1:
            ((x, y),) = run
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{width}" fill="{colour}" class="{role}"/>')
        else:
            out.append(
                f'<polyline points="{_points(run)}" fill="none" stroke="{colour}" stroke-width="{width}"'
                f'{dashed} stroke-linejoin="round" class="{role}"/>'
            )
    return out


def _band(box: _Box, times, low, high) -> list[str]:
    both = [lo if _ok(lo) and _ok(hi) else math.nan for lo, hi in zip(low, high)]
    out = []
    for lows, highs in zip(
        _segments(box, times, both), _segments(box, times, [h if _ok(b) else math.nan for b, h in zip(both, high)])
    ):
        ring = lows + highs[::-1]
        out.append(
            f'<polygon points="{_points(ring)}" fill="{BAND_COLOUR}" fill-opacity="0.6" stroke="none" class="band"/>'
        )
    return out


def _ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _y_axis(box: _Box, name: str, unit: str, digits: int, ticks: Sequence[float] | None = None) -> str:
    out = []
    for v in ticks if ticks is not None else _ticks(box.y0, box.y1):
        y = box.y(v)
        out.append(
            f'<line x1="{box.left}" x2="{box.right}" y1="{y:.1f}" y2="{y:.1f}" stroke="{GRID_COLOUR}"/>'
            f'<text x="{box.left - 4}" y="{y + 4:.1f}" text-anchor="end" class="lbl">{v:.{digits}f}</text>'
        )
    if name:
        mid = (box.top + box.bottom) / 2
        out.append(
            f'<text transform="translate(12 {mid:.0f}) rotate(-90)" text-anchor="middle" class="lbl axis">'
            f"{escape(name)} ({escape(unit)})</text>"
        )
    return "".join(out)


def _x_axis(box: _Box, tz: tzinfo | None, n: int = 5, caption: bool = True) -> str:
    """Ticks at round times (whole minutes, quarter hours...), at most about `n`, and the zone named."""
    out = [f'<line x1="{box.left}" x2="{box.right}" y1="{box.bottom}" y2="{box.bottom}" stroke="#8a939c"/>']
    ticks = _time_ticks(box.x0, box.x1, box.x0 + _local(box.x0, tz).utcoffset().total_seconds(), n)  # type: ignore[union-attr]
    fmt = "%H:%M:%S" if len(ticks) > 1 and ticks[1] - ticks[0] < 60 else "%H:%M"
    for i, t in enumerate(ticks):
        # Without the axis caption, the last label names the zone.
        label = _local(t, tz).strftime(fmt if caption or i < len(ticks) - 1 else fmt + " %Z").strip()
        x = box.x(t)
        half = 3.2 * len(label)  # about half its width at the labels' 11 px: kept inside the picture
        anchor = "end" if x + half > box.width else "start" if x - half < 0 else "middle"
        out.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{box.bottom}" y2="{box.bottom + 3}" stroke="#8a939c"/>'
            f'<text x="{x:.1f}" y="{box.bottom + 13}" text-anchor="{anchor}" class="lbl">{escape(label)}</text>'
        )
    if caption:
        zone = _local(box.x1, tz).strftime("%Z") or "local"
        mid = (box.left + box.right) / 2
        out.append(
            f'<text x="{mid:.0f}" y="{box.bottom + 27}" text-anchor="middle" class="lbl axis">time ({escape(zone)})</text>'
        )
    return "".join(out)


def _time_ticks(x0: float, x1: float, local_x0: float, n: int) -> list[float]:
    """Multiples of the smallest round step giving at most n ticks in [x0, x1], round in local time
    (local_x0 is x0 plus the zone's offset: a half-hour zone's ticks fall on its own hours)."""
    span = x1 - x0
    step = next((s for s in TIME_STEPS_SECONDS if span / s <= n), TIME_STEPS_SECONDS[-1])
    shift = x0 - local_x0
    first = math.ceil(local_x0 / step) * step + shift
    return [first + i * step for i in range(int((x1 - first) / step) + 1)]


def _mark(box: _Box, t: float, label: str) -> str:
    x = box.x(t)
    return (
        f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{box.top}" y2="{box.bottom}" stroke="{MARK_COLOUR}" stroke-dasharray="2 2"'
        f' class="mark"/><text x="{x + 3:.1f}" y="{box.top + 10}" class="lbl">{escape(label)}</text>'
    )


def _legend(box: _Box, items: list[tuple[str, str, str]]) -> str:
    out, x = [], box.left
    for colour, shape, text in items:
        if shape == "band":
            out.append(f'<rect x="{x}" y="4" width="16" height="10" fill="{colour}" fill-opacity="0.6"/>')
        else:
            dash = ' stroke-dasharray="5 3"' if shape == "dash" else ""
            w = 2.5 if shape == "line" else 1.5
            out.append(f'<line x1="{x}" x2="{x + 16}" y1="9" y2="9" stroke="{colour}" stroke-width="{w}"{dash}/>')
        out.append(f'<text x="{x + 20}" y="13" class="lbl">{escape(text)}</text>')
        x += 28 + 7 * len(text)
    return '<g class="legend">' + "".join(out) + "</g>"


def _describe(s: Series, subject: str | None, name: str, unit: str, digits: int, tz: tzinfo | None) -> str:
    """The picture in words: its span and the latest values."""
    last = {
        col: next((v for v in reversed(vals) if _ok(v)), None)
        for col, vals in (("subject", s.subject), ("median", s.median))
    }
    when = f"from {_local(s.times[0], tz):%H:%M} to {_local(s.times[-1], tz):%H:%M %Z}".rstrip()
    words = [f"{name} ({unit}) {when}."]
    if subject and last["subject"] is not None:
        words.append(f"Latest: {subject} {last['subject']:.{digits}f}")
    if last["median"] is not None:
        words.append(("against " if len(words) > 1 else "Latest: ") + f"median {last['median']:.{digits}f}")
    return " ".join(words)


def _local(t: float, tz: tzinfo | None) -> datetime:
    return datetime.fromtimestamp(t, tz) if tz is not None else datetime.fromtimestamp(t).astimezone()


def _step(value: float, steps) -> tuple[str, bool]:
    """The colour of a value, and whether it stands out: the hot end, or either end of the relative scale."""
    if not _ok(value):
        return NO_DATA_COLOUR, False
    i = next(i for i, (bound, _, _) in enumerate(steps) if value < bound)  # the last bound is inf
    return steps[i][1], i == len(steps) - 1 or (steps is RELATIVE_STEPS and i == 0)


def _grid_rows(cells: Sequence[FleetCell], per_node: bool, per_row: int = 40) -> list[tuple[str, list[FleetCell]]]:
    if per_node:
        return [("", list(cells[i : i + per_row])) for i in range(0, len(cells), per_row)]
    rows: dict[str, list[FleetCell]] = {}
    for cell in cells:
        rows.setdefault(cell.node, []).append(cell)
    return list(rows.items())


def _cell_words(cell: FleetCell) -> str:
    where = cell.node if cell.gpu is None else f"{cell.node} GPU {cell.gpu}"
    if cell.gpu is None:
        where += f" ({cell.gpus} GPUs)"
    job = f", job {cell.job}" if cell.job else ", no job"
    temp = f"{cell.temperature_celsius:.0f} °C" if _ok(cell.temperature_celsius) else "temperature unknown"
    rel = (
        f"SM activity {cell.sm_vs_job_ratio:.2f} × its job's median"
        if _ok(cell.sm_vs_job_ratio)
        else "SM activity vs its job unknown"
    )
    return f"{where}{job}: {temp}, {rel}"


def _grid_desc(cells: Sequence[FleetCell], colour_by: str, steps) -> str:
    flagged = [
        c for c in cells if _step(c.temperature_celsius if colour_by == "temperature" else c.sm_vs_job_ratio, steps)[1]
    ]
    if not flagged:
        return f"{len(cells)} squares, none at either end of the scale."
    return f"{len(cells)} squares; standing out: " + "; ".join(_cell_words(c) for c in flagged[:10])
