"""Replay from a database gives the alerts of replay of the recorded files of the same run (real processes).

Two simulated agents (the demo's job 71001: dgx-01 and dgx-02, whose GPU 5 loses its cooling from +200 s)
started at +230 s, each also writing its snapshots with --record; a real VictoriaMetrics scrapes both every
second. Once replay of the record files shows the thermal alert, the agents stop, and
`gpufleet-server replay --prometheus-url` over the range the database holds must print the same alerts as
`gpufleet-server replay` of the record files over that range: same kinds and subjects, start times within
one engine cycle. The two paths differ where a database differs from a record file: a scrape every second
of an agent that samples every second keeps most samples, not all, and the utilization ratios come from
the agents' activity counters between scrapes.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import orjson
import pytest

from bench.evaluation import victoria
from gpufleet.server.engine import EngineConfig
from gpufleet.server.replay import run_replay
from tests.agent.running import ROOT, agent_process

pytestmark = pytest.mark.skipif(victoria.BINARY is None, reason=victoria.WHY_MISSING)

NODES = ("dgx-01", "dgx-02")
TICK_SECONDS = EngineConfig().tick_seconds
# Alerts this close to the end of the range may be raised by one path a cycle before the other has the
# samples to: compared only up to here.
MARGIN_SECONDS = 3 * TICK_SECONDS


def _replay_cli(*args: str) -> list[dict]:
    done = subprocess.run(
        [sys.executable, "-m", "gpufleet.server.cli", "replay", *args],
        cwd=ROOT,
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    return [orjson.loads(line) for line in done.stdout.splitlines()]


def _until(what: str, check, seconds: float) -> None:
    waiter = threading.Event()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return
        waiter.wait(1.0)
    pytest.fail(f"never within {seconds:g} s: {what}")


def _lines(paths: list[Path]) -> list[bytes]:
    return [line for path in paths if path.exists() for line in path.read_bytes().splitlines() if line]


def _thermal_long_before_the_end(paths: list[Path]) -> bool:
    """Whether replay of the record files shows the thermal alert, started well before their last sample."""
    lines = _lines(paths)
    if not lines:
        return False
    last = max(orjson.loads(line)["time"] for line in lines)
    return any(
        a.kind.value == "thermal_throttle" and a.started < last - MARGIN_SECONDS - TICK_SECONDS
        for a in run_replay(lines)
    )


def _newest_scrapes(url: str) -> dict[str, float]:
    """node -> time of the newest scrape the database holds of it."""
    answer = httpx.get(f"{url}/api/v1/query", params={"query": "timestamp(gpufleet_agent_sample_age_seconds)"})
    return {s["metric"]["node"]: float(s["value"][1]) for s in answer.json()["data"]["result"]}


def _key(alert: dict) -> tuple:
    """Kind and subject: the GPU or node where the alert names one, else the job (as the evaluation
    matches alerts, bench/evaluation/scenarios.py). A GPU's job is not part of it: the agent names a job
    from its second sample on, and which of the first samples a scrape kept can decide whether the job
    was known long enough when an alert at the start of the run fired."""
    if alert["node"] is not None:
        return alert["kind"], alert["node"], alert["gpu"]
    return alert["kind"], alert["hpc_job"]


def test_replay_of_the_database_gives_the_alerts_of_replay_of_the_record_files(tmp_path: Path) -> None:
    epoch = time.time() - 230.0
    records = [tmp_path / f"{node}.jsonl" for node in NODES]
    scrape = tmp_path / "scrape.yml"
    with contextlib.ExitStack() as database, contextlib.ExitStack() as agents:
        ports = [
            agents.enter_context(
                agent_process("--simulate", "demo", "--node", node, "--simulate.epoch", repr(epoch), "--record", str(r))
            )[1]
            for node, r in zip(NODES, records)
        ]
        targets = ", ".join(f"'127.0.0.1:{p}'" for p in ports)
        scrape.write_text(
            "global: {scrape_interval: 1s, scrape_timeout: 1s}\n"
            f"scrape_configs:\n  - job_name: gpufleet-agent\n    static_configs: [{{targets: [{targets}]}}]\n"
        )
        url = database.enter_context(victoria.victoria_metrics(tmp_path, scrape))
        _until("the thermal alert in replay of the record files", lambda: _thermal_long_before_the_end(records), 180)
        agents.close()  # their record files closed; the database keeps what it scraped
        victoria.flush(url)
        newest = _newest_scrapes(url)
        lines = _lines(records)
        start = min(orjson.loads(line)["time"] for line in lines) - 1.0
        end = min(newest.values())
        kept = tmp_path / "kept.jsonl"
        kept.write_bytes(b"".join(line + b"\n" for line in lines if orjson.loads(line)["time"] <= end))
        from_files = _replay_cli(str(kept))
        from_database = _replay_cli(
            "--prometheus-url", url, "--start", repr(start), "--end", repr(end), "--chunk", "30"
        )
    assert set(newest) == set(NODES), newest
    thermal = [a["started"] for a in from_files if _key(a) == ("thermal_throttle", "dgx-02", 5)]
    assert len(thermal) == 1 and thermal[0] <= end - MARGIN_SECONDS, from_files
    compared = end - MARGIN_SECONDS
    for ours, theirs, what in ((from_files, from_database, "database"), (from_database, from_files, "files")):
        for alert in ours:
            if alert["started"] > compared:
                continue
            twins = [a for a in theirs if _key(a) == _key(alert)]
            assert twins, f"replay of the {what} lacks {_key(alert)}: {[_key(a) for a in theirs]}"
            assert min(abs(a["started"] - alert["started"]) for a in twins) <= TICK_SECONDS, (alert, twins)
