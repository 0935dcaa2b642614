"""The pages' pictures as a person sees them: headless Chromium, offline but for 127.0.0.1, against the real
server that pulled the demo cluster to +320 s (tests/test_status_page_browser.py), with the cooling failure
on dgx-02 GPU 5 and the slow dgx-03 GPU 2 both firing.

Each page is rendered twice, once for its DOM and once for a screenshot (saved in the test's tmp dir for a
person to look at), each time with Chromium's network log on: every request the page made must be to the
server.
"""

from __future__ import annotations

import re
import struct
import subprocess
from pathlib import Path

import orjson
import pytest

from tests.test_status_page_browser import CHROMIUM, offline_chromium, server, text_of  # noqa: F401 - server is a fixture

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install chromium)")


def chromium(url: str, tmp_path: Path, name: str, *extra: str) -> tuple[str, list[str]]:
    """Chromium's stdout for `url` with `extra` flags, and every URL its network log saw requested."""
    netlog = tmp_path / f"{name}.netlog.json"
    cmd = [*offline_chromium(tmp_path), "--hide-scrollbars", f"--log-net-log={netlog}", *extra, url]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, requested(netlog)


def requested(netlog: Path) -> list[str]:
    """The URLs the page asked for, from a Chromium network log: every request whose network isolation key
    is the page's site (the top frame at 127.0.0.1), so Chromium's own background calls, keyed to their own
    sites and refused by the resolver anyway, are not the page's."""
    log = orjson.loads(netlog.read_bytes())
    start = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    return [
        e["params"]["url"]
        for e in log["events"]
        if e["type"] == start and e.get("params", {}).get("network_isolation_key", "").startswith("http://127.0.0.1 ")
    ]


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def render(base: str, path: str, tmp_path: Path, name: str) -> str:
    """The page's DOM; its screenshot saved as tmp_path/name.png; no request anywhere but the server."""
    dom, seen = chromium(base + path, tmp_path, f"{name}-dom", "--dump-dom")
    shot = tmp_path / f"{name}.png"
    _, seen_shot = chromium(base + path, tmp_path, f"{name}-shot", f"--screenshot={shot}", "--window-size=1400,1800")
    assert base + path in seen and base + path in seen_shot
    elsewhere = [u for u in seen + seen_shot if not u.startswith(base + "/")]
    assert not elsewhere, elsewhere
    assert png_size(shot) == (1400, 1800) and shot.stat().st_size > 20_000
    return dom


def test_the_straggler_page_shows_it_against_its_peers(server, tmp_path: Path) -> None:  # noqa: F811
    base, runtime = server
    (alert,) = [
        a
        for a in runtime.view.alerts
        if a.kind.value == "straggler" and (a.node, a.gpu) == ("dgx-03", 2) and a.state.value == "firing"
    ]
    dom = render(base, f"/ui/alerts/{alert.id}", tmp_path, "alert")
    charts = re.findall(r"<svg.*?</svg>", dom, flags=re.S)
    assert len(charts) == 2, len(charts)
    for chart in charts:
        assert 'role="img"' in chart and "against its 15 peers" in chart
        for part in ('class="subject"', 'class="median"', 'class="band"', 'class="legend"', 'class="mark"'):
            assert part in chart, part
    words = text_of(dom)
    assert "SM activity (ratio 0-1)" in words and "power (W)" in words and "dgx-03 GPU 2" in words


def test_the_status_page_shows_each_job_and_the_fleet(server, tmp_path: Path) -> None:  # noqa: F811
    base, _ = server
    dom = render(base, "/", tmp_path, "status")
    assert "GPUs now" in dom and dom.count('class="cell') == 64  # 32 GPUs, by temperature and against their job
    hot = re.search(r'<rect [^>]*class="cell out"[^>]*><title>dgx-02 GPU 5, job 71001: (\d+) °C', dom)
    assert hot and int(hot.group(1)) >= 85, hot
    slow = re.search(r'<rect [^>]*class="cell out"[^>]*><title>dgx-03 GPU 2, job 71002: \d+ °C, SM activity 1\.', dom)
    assert slow, "the straggler's square stands out from its job"
    for job in ("71001", "71002"):
        assert f"job {job}: SM activity over the last hour" in dom
