"""The pages' SVG pictures, built from plain series: lines, band, axes with units and local times, the
legend, accessible names, and a "no data" note instead of a broken picture."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from datetime import timedelta, timezone

import pytest

from gpufleet.server.api.charts import (
    BAND_COLOUR,
    NO_DATA_COLOUR,
    RELATIVE_STEPS,
    SUBJECT_COLOUR,
    TEMPERATURE_STEPS,
    fleet_grid,
    job_chart,
    time_chart,
)
from gpufleet.server.history import FleetCell, Series

SVG = "{http://www.w3.org/2000/svg}"
T = 1_763_800_000.0  # 08:26:40 UTC
NAN = math.nan


def svg(text: str) -> ET.Element:
    return ET.fromstring(text)


def series(reading: str = "power_watts", n: int = 12, **kw) -> Series:
    times = tuple(T + 5.0 * i for i in range(n))
    base = dict(
        reading=reading,
        times=times,
        subject=tuple(600.0 for _ in times),
        median=tuple(480.0 for _ in times),
        low=tuple(470.0 for _ in times),
        high=tuple(490.0 for _ in times),
        peers=15,
    )
    base.update(kw)
    return Series(**base)  # type: ignore[arg-type]


def test_the_subject_line_the_peers_median_and_band():
    root = svg(time_chart(series(), subject="dgx-03 GPU 2", tz=timezone.utc))
    (subject,) = root.findall(f".//{SVG}polyline[@class='subject']")
    (median,) = root.findall(f".//{SVG}polyline[@class='median']")
    (band,) = root.findall(f".//{SVG}polygon[@class='band']")
    assert subject.get("stroke") == SUBJECT_COLOUR and band.get("fill") == BAND_COLOUR
    assert median.get("stroke-dasharray")
    # One vertex a point; the band goes out along the low edge and back along the high one.
    assert len(subject.get("points", "").split()) == 12 and len(band.get("points", "").split()) == 24
    ys = lambda el: [float(p.split(",")[1]) for p in el.get("points", "").split()]  # noqa: E731
    # Higher values are higher up: the subject's 600 W above the median's 480 W, inside the band's edges.
    assert max(ys(subject)) < min(ys(median)) and min(ys(band)) < ys(median)[0] < max(ys(band))


def test_axes_name_the_unit_and_the_local_time_zone():
    cest = timezone(timedelta(hours=2), "CEST")
    root = svg(time_chart(series(), subject="dgx-03 GPU 2", tz=cest))
    words = [t.text or "" for t in root.iter(f"{SVG}text")]
    assert "power (W)" in words and "time (CEST)" in words
    # 55 s of points: a tick every 15 s, on round times of that zone.
    assert [w for w in words if w.startswith("10:")] == ["10:26:45", "10:27:00", "10:27:15", "10:27:30"]
    utc = [t.text for t in svg(time_chart(series(), subject="x", tz=timezone.utc)).iter(f"{SVG}text")]
    assert "08:26:45" in utc and "time (UTC)" in utc
    sm = series("sm_active_ratio", subject=(0.7,) * 12, median=(0.5,) * 12, low=(0.45,) * 12, high=(0.55,) * 12)
    ratio = [t.text for t in svg(time_chart(sm, subject="x")).iter(f"{SVG}text")]
    assert "SM activity (ratio 0-1)" in ratio and "0.00" in ratio and "1.00" in ratio


def test_an_accessible_name_a_description_and_a_legend():
    root = svg(time_chart(series(), subject="dgx-03 GPU 2", tz=timezone.utc))
    assert root.get("role") == "img"
    ids = root.get("aria-labelledby", "").split()
    named = {el.get("id"): el.text for el in root if el.get("id")}
    assert ids and all(i in named for i in ids)
    assert named[ids[0]] == "power of dgx-03 GPU 2 against its 15 peers"
    assert "Latest: dgx-03 GPU 2 600" in named[ids[1]] and "median 480" in named[ids[1]]
    legend = [t.text for t in root.find(f"{SVG}g[@class='legend']").iter(f"{SVG}text")]  # type: ignore[union-attr]
    assert legend == ["dgx-03 GPU 2", "peers' median", "peers' 25th-75th percentile"]


def test_absent_readings_break_the_line_and_never_reach_the_picture():
    gappy = series(subject=(600.0,) * 4 + (NAN,) * 2 + (610.0,) * 6, low=(470.0,) * 5 + (NAN,) + (470.0,) * 6)
    text = time_chart(gappy, subject="dgx-03 GPU 2", tz=timezone.utc)
    root = svg(text)
    runs = root.findall(f".//{SVG}polyline[@class='subject']")
    assert [len(r.get("points", "").split()) for r in runs] == [4, 6]
    assert len(root.findall(f".//{SVG}polygon[@class='band']")) == 2
    assert "nan" not in text.lower().replace("nanoseconds", "")


@pytest.mark.parametrize(
    "empty",
    [
        series(times=(), subject=(), median=(), low=(), high=()),
        series(subject=(NAN,) * 12, median=(NAN,) * 12, low=(NAN,) * 12, high=(NAN,) * 12),
    ],
    ids=["no points", "all absent"],
)
def test_nothing_to_draw_is_a_no_data_note(empty):
    text = time_chart(empty, subject="dgx-03 GPU 2")
    assert "<svg" not in text and "no data" in text and 'role="note"' in text
    assert "no data" in job_chart(empty, job="71002") and "<svg" not in job_chart(empty, job="71002")
    assert "no data" in fleet_grid((), colour_by="temperature", per_node=False)


def test_a_whole_job_has_no_subject_line():
    root = svg(time_chart(series(subject=()), subject=None, tz=timezone.utc))
    assert not root.findall(f".//{SVG}polyline[@class='subject']") and root.findall(
        f".//{SVG}polyline[@class='median']"
    )
    legend = [t.text for t in root.find(f"{SVG}g[@class='legend']").iter(f"{SVG}text")]  # type: ignore[union-attr]
    assert legend == ["GPUs' median", "GPUs' 25th-75th percentile"]


def test_marks_inside_the_span_only():
    root = svg(time_chart(series(), subject="x", marks=[(T + 20, "pending"), (T - 600, "old")], tz=timezone.utc))
    marks = root.findall(f".//{SVG}line[@class='mark']")
    assert len(marks) == 1 and "pending" in [t.text for t in root.iter(f"{SVG}text")]


def test_a_jobs_hour_spans_the_hour_on_a_fixed_ratio_scale():
    job = series("sm_active_ratio", n=30, subject=(), median=(0.5,) * 30, low=(0.4,) * 30, high=(0.6,) * 30)
    job = Series(job.reading, tuple(T + 60.0 * i for i in range(30)), (), job.median, job.low, job.high)
    root = svg(job_chart(job, job="71002", tz=timezone.utc))
    words = [t.text for t in root.iter(f"{SVG}text")]
    assert root.find(f"{SVG}title").text == "job 71002: SM activity over the last hour"  # type: ignore[union-attr]
    # The axis starts an hour before the newest point, though the job is younger.
    assert words == ["0.0", "0.5", "1.0", "08:00", "08:30 UTC"]
    # A tick near the right edge: its label, zone and all, ends inside the picture.
    young = Series(job.reading, job.times[:6], (), job.median[:6], job.low[:6], job.high[:6])
    edge = svg(job_chart(young, job="71002", tz=timezone.utc))
    (last,) = [t for t in edge.iter(f"{SVG}text") if t.text == "08:30 UTC"]
    assert last.get("text-anchor") == "end" and float(last.get("x", "0")) <= float(edge.get("width", "0"))
    ist = svg(job_chart(job, job="71002", tz=timezone(timedelta(hours=5, minutes=30), "IST")))
    assert [t.text for t in ist.iter(f"{SVG}text")][3:] == ["13:30", "14:00 IST"]
    assert root.findall(f".//{SVG}polygon[@class='band']")


def cell(node: str, gpu: int | None, temp: float, rel: float, gpus: int = 1) -> FleetCell:
    return FleetCell(node=node, gpu=gpu, gpus=gpus, job="71001", temperature_celsius=temp, sm_vs_job_ratio=rel)


def test_the_fleet_grid_makes_the_hot_and_the_slow_gpu_stand_out():
    cells = [cell("dgx-01", g, 60.0, 1.0) for g in range(8)] + [cell("dgx-02", g, 60.0, 1.0) for g in range(8)]
    cells[10] = cell("dgx-02", 2, 91.0, 1.4)
    cells[3] = cell("dgx-01", 3, NAN, NAN)
    hot = svg(fleet_grid(cells, colour_by="temperature", per_node=False))
    squares = [sq for sq in hot.iter(f"{SVG}rect") if "cell" in sq.get("class", "")]
    assert len(squares) == 16
    titled = {sq.find(f"{SVG}title").text: sq for sq in squares}  # type: ignore[union-attr]
    culprit = titled["dgx-02 GPU 2, job 71001: 91 °C, SM activity 1.40 × its job's median"]
    assert culprit.get("fill") == TEMPERATURE_STEPS[-1][1] and culprit.get("class") == "cell out"
    assert (
        titled["dgx-01 GPU 0, job 71001: 60 °C, SM activity 1.00 × its job's median"].get("fill")
        == TEMPERATURE_STEPS[1][1]
    )
    unknown = next(sq for t, sq in titled.items() if t.startswith("dgx-01 GPU 3"))
    assert unknown.get("fill") == NO_DATA_COLOUR
    # A row per node, named; the legend lists every colour with its range.
    words = [t.text for t in hot.iter(f"{SVG}text")]
    assert "dgx-01" in words and "dgx-02" in words and "85 °C and above" in words and "no data" in words
    assert "standing out: dgx-02 GPU 2" in hot.find(f"{SVG}desc").text  # type: ignore[operator, union-attr]
    slow = svg(fleet_grid(cells, colour_by="relative", per_node=False))
    fills = [sq.get("fill") for sq in slow.iter(f"{SVG}rect") if "cell" in sq.get("class", "")]
    assert fills.count(RELATIVE_STEPS[-1][1]) == 1 and fills.count(RELATIVE_STEPS[2][1]) == 14


def test_per_node_squares_wrap_and_say_what_they_hold():
    cells = [cell(f"n{i:04d}", None, 60.0, 1.0, gpus=8) for i in range(100)]
    root = svg(fleet_grid(cells, colour_by="relative", per_node=True))
    squares = root.findall(f".//{SVG}rect[@class='cell']")
    assert len(squares) == 100 and len({sq.get("y") for sq in squares}) == 3  # 40 a row
    assert squares[0].find(f"{SVG}title").text.startswith("n0000 (8 GPUs), job 71001")  # type: ignore[union-attr]
    assert "hottest GPU of each node" in root.find(f"{SVG}title").text  # type: ignore[operator, union-attr]


def test_every_picture_is_escaped():
    evil = "<script>x</script>"
    text = time_chart(series(), subject=evil, tz=timezone.utc)
    assert "<script>" not in text and svg(text) is not None
    grid = fleet_grid([FleetCell(evil, 0, 1, evil, 60.0, 1.0)], colour_by="temperature", per_node=False)
    assert "<script>" not in grid and svg(grid) is not None
