"""Every metric family the agent and the server serve on /metrics has a row in their doc's metrics table.

A real `gpufleet-agent --simulate demo` and a real `gpufleet-server` pulling it (with a webhook configured,
so the notifier families exist) are scraped once each has something to say; the families named in their
`# TYPE` lines are compared with the names in docs/agent.md's and docs/server.md's tables. The rule for a
documented name: a backticked `gpufleet_...` (or `process_...`) word in a table row (a line starting with `|`), written in
full as it appears in the exposition (counters with `_total`).
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Callable

import httpx

from tests.agent.running import ROOT, agent_process, server_process

_NAME = re.compile(r"`((?:gpufleet|process)_[a-z0-9_]*[a-z0-9])`")
_TYPE = re.compile(r"^# TYPE (\S+) ", re.M)


def documented(doc: Path) -> set[str]:
    """The metric names in a doc's table rows."""
    return {name for line in doc.read_text().splitlines() if line.startswith("|") for name in _NAME.findall(line)}


def served(exposition: str) -> set[str]:
    """The metric families an exposition declares."""
    return set(_TYPE.findall(exposition))


def scrape_until(url: str, ready: Callable[[str], bool], seconds: float = 90.0) -> str:
    """/metrics once `ready` says the exposition has everything a first start can show; fails after `seconds`."""
    waiter = threading.Event()
    text = ""
    for _ in range(int(seconds / 0.5)):
        try:
            text = httpx.get(url, timeout=5).text
        except httpx.TransportError:
            text = ""
        if ready(text):
            return text
        waiter.wait(0.5)
    raise AssertionError(f"{url} never had everything to show; last scrape:\n{text[-3000:]}")


def test_the_docs_tables_name_every_metric_served(tmp_path: Path) -> None:
    with agent_process("--simulate", "demo", "--node", "dgx-03", "--sample.interval", "0.5", "--nvlink.per-link") as (
        _,
        agent_port,
    ):
        # GPM needs two samples before SM activity is read; the sample age only exists after the first.
        agent = scrape_until(
            f"http://127.0.0.1:{agent_port}/metrics",
            lambda t: "gpufleet_gpu_sm_active_ratio{" in t and "gpufleet_agent_sample_age_seconds " in t,
        )
        with server_process(
            tmp_path,
            "--targets",
            f"127.0.0.1:{agent_port}",
            "--pull.interval",
            "1s",
            "--pull.timeout",
            "1s",
            "--webhook.url",
            "http://127.0.0.1:9/hook",
        ) as (_, server_port):
            # Per-job and per-node families appear once the engine has evaluated a tick with samples.
            server = scrape_until(
                f"http://127.0.0.1:{server_port}/metrics",
                lambda t: (
                    "gpufleet_job_gpus{" in t
                    and "gpufleet_node_gpus{" in t
                    and "gpufleet_server_engine_last_tick_timestamp_seconds " in t
                ),
            )
    missing = {
        doc: sorted(served(text) - documented(ROOT / "docs" / doc))
        for doc, text in (("agent.md", agent), ("server.md", server))
    }
    assert missing == {"agent.md": [], "server.md": []}, (
        "metrics served but missing from the docs' tables: "
        + "; ".join(f"docs/{doc}: {', '.join(names)}" for doc, names in missing.items() if names)
    )
    assert len(served(agent)) > 30 and len(served(server)) > 30  # the scrapes were whole expositions


def test_table_names_are_read_from_table_rows_only(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "Prose naming `gpufleet_not_in_a_table` is not a row.\n\n| series | meaning |\n|---|---|\n"
        "| `gpufleet_a_total`, `gpufleet_b` | prefix `gpufleet_` alone is no name |\n"
    )
    assert documented(doc) == {"gpufleet_a_total", "gpufleet_b"}
    exposition = "# HELP gpufleet_a_total x\n# TYPE gpufleet_a_total counter\ngpufleet_a_total 1\n"
    assert served(exposition) == {"gpufleet_a_total"}


def test_the_flag_and_metric_tables_live_in_the_docs_only() -> None:
    # One table per program, in docs/agent.md and docs/server.md: a second copy in the README drifts.
    readme = ROOT / "README.md"
    flag_rows = [line for line in readme.read_text().splitlines() if line.startswith("| `--")]
    assert documented(readme) == set() and flag_rows == []
    assert "docs/agent.md#metrics" in readme.read_text() and "docs/server.md#metrics" in readme.read_text()
