"""The status page and /docs as a person sees them: headless Chromium against a real server on loopback.

The server is the real app (uvicorn on 127.0.0.1, port 0) around the real pipeline (puller, engine,
store). Its agents serve the demo cluster as the agent pipeline recorded it on the simulator
(bench/evaluation/sim_record.py), on a clock the test moves five seconds per pull: the demo's incidents start
from +200 s, and live agents would take minutes to get there. At +320 s the cooling failure on
dgx-02 GPU 5 and the slow dgx-03 GPU 2 are both still on, their alerts firing.

Chromium runs with every host name but 127.0.0.1 unresolvable, as on an air-gapped cluster.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import uvicorn

from bench.evaluation.sim_record import T0, record_cluster
from gpufleet.agent.sim import load_scenario
from gpufleet.server.api import create_app
from gpufleet.server.runtime import Runtime
from gpufleet.server.serve import build_runtime, listen_socket
from gpufleet.server.settings import ServerSettings
from tests.server.live_fakes import StepClock, recorded_agents

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install chromium)")

RECORDED_SECONDS = 320
PULL_SECONDS = 5.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Runtime]]:
    """Base URL of a server that has pulled the demo cluster up to +320 s."""
    tmp = tmp_path_factory.mktemp("page")
    demo = load_scenario("demo")
    lines = record_cluster(demo, tmp, RECORDED_SECONDS, 1.0)
    clock = StepClock(T0)
    settings = ServerSettings(
        targets=tuple(f"{node}:9471" for node in demo.nodes),
        pull_interval_seconds=PULL_SECONDS,
        storage_path=str(tmp / "server.db"),
        listen_address="127.0.0.1:0",
    )
    runtime = build_runtime(settings, clock=clock, transport=recorded_agents(lines, clock))

    async def pull_through_the_recording() -> None:
        while clock.now < T0 + RECORDED_SECONDS:
            clock.now += PULL_SECONDS
            await runtime.cycle()

    asyncio.run(pull_through_the_recording())
    sock = listen_socket("127.0.0.1:0")
    web = uvicorn.Server(
        uvicorn.Config(
            create_app(settings, runtime=runtime, run_pipeline=False), log_config=None, access_log=False, lifespan="on"
        )
    )
    thread = threading.Thread(target=web.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{sock.getsockname()[1]}"
        for _ in range(200):
            if web.started:
                break
            threading.Event().wait(0.05)
        assert web.started, "uvicorn did not start"
        yield base, runtime
    finally:
        web.should_exit = True
        thread.join(timeout=10)
        sock.close()
        runtime.store.close()


def offline_chromium(tmp_path: Path) -> list[str]:
    """Headless Chromium's command, its profile under `tmp_path`, every host name but 127.0.0.1 unresolvable."""
    assert CHROMIUM is not None
    return [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    ]


def chromium_dom(url: str, tmp_path: Path, *, js_budget_ms: int = 0) -> str:
    """The DOM Chromium built for `url` (after `js_budget_ms` of virtual time for scripts), offline but for
    127.0.0.1."""
    cmd = offline_chromium(tmp_path)
    if js_budget_ms:
        cmd.append(f"--virtual-time-budget={js_budget_ms}")
    done = subprocess.run([*cmd, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "<html" in done.stdout, done.stderr[-2000:]
    return done.stdout


def text_of(dom: str) -> str:
    """The visible words, tags dropped and entities kept as they are (enough for the strings checked)."""
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))


def test_status_page_names_the_culprit_gpus_and_their_jobs(server, tmp_path: Path) -> None:
    base, runtime = server
    firing = {(a.kind.value, a.node, a.gpu) for a in runtime.view.alerts if a.state.value == "firing"}
    assert {("straggler", "dgx-03", 2), ("thermal_throttle", "dgx-02", 5)} <= firing, firing
    dom = chromium_dom(base + "/", tmp_path)
    words = text_of(dom)
    assert "Jobs" in words and "71001" in words and "71002" in words
    # Each job's row names the GPU holding it back; the firing alerts name it with its job.
    assert "straggler dgx-03 GPU 2" in words and "straggler dgx-02 GPU 5" in words
    assert "dgx-03 GPU 2 (job 71002)" in words and "dgx-02 GPU 5 (job 71001)" in words
    assert "thermal_throttle" in words and "4 of 4 agents up" in words.replace("</b>", "")
    # The straggler's own page, reached by the link a person would click.
    (href,) = set(re.findall(r'href="(/ui/alerts/[^"]+)">straggler dgx-03 GPU 2<', dom))
    alert_words = text_of(chromium_dom(base + href, tmp_path))
    assert "straggler: dgx-03 GPU 2 (job 71002)" in alert_words
    assert "GPU 2 on dgx-03 is the slow one: " in alert_words and "peers wait for it" in alert_words
    assert "job slowdown put down to it" in alert_words and "Evidence" in alert_words
    assert "estimated_job_slowdown_ratio" not in alert_words and "What to do:" in alert_words


def test_docs_render_offline_from_the_servers_own_files(server, tmp_path: Path) -> None:
    base, _ = server
    html = httpx.get(base + "/docs", timeout=30).text
    loads = re.findall(r'<(?:script|link)[^>]*(?:src|href)="([^"]+)"', html)
    assert loads and all(u.startswith("/") and not u.startswith("//") for u in loads), loads
    for url in loads:
        assert httpx.get(base + url, timeout=30).status_code == 200, url
    dom = chromium_dom(base + "/docs", tmp_path, js_budget_ms=15_000)
    # Swagger UI filled its root from /openapi.json: the title and the routes are on the page.
    assert 'id="swagger-ui"' in dom and "gpufleet server" in text_of(dom), dom[:2000]
    assert "/alerts/{alert_id}" in dom and "/jobs" in dom
