"""The status page (`/`, `/ui/alerts/{id}`) and `/docs`, in process: what they show, escaping, auth, and that
nothing they load comes from anywhere but the server itself."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import datetime
from html.parser import HTMLParser
from urllib.parse import urlsplit

import bcrypt
import httpx
import pytest
from fastapi.testclient import TestClient

from gpufleet.server.alerts import AlertKind, AlertState, Severity
from gpufleet.server.api import create_app
from gpufleet.server.api.evidence import local_time
from gpufleet.server.api.page import refresh_seconds
from gpufleet.server.ingest.puller import Puller
from gpufleet.server.ingest.targets import StaticTargets
from gpufleet.server.routing import AlertRouting
from gpufleet.server.runtime import FleetView, Runtime
from gpufleet.server.settings import ServerSettings
from gpufleet.server.store import AlertStore
from gpufleet.webconfig import WebConfig
from tests.server.live_fakes import StubEngine, make_alert, parse_dict

HASH = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4))


class Refs(HTMLParser):
    """Every URL a page loads (script src, link href, img src) or links to (a href), and its meta refresh."""

    def __init__(self) -> None:
        super().__init__()
        self.loads: list[str] = []
        self.links: list[str] = []
        self.refresh: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag in ("script", "img") and a.get("src"):
            self.loads.append(a["src"] or "")
        elif tag == "link" and a.get("href"):
            self.loads.append(a["href"] or "")
        elif tag == "a" and a.get("href"):
            self.links.append(a["href"] or "")
        elif tag == "meta" and (a.get("http-equiv") or "").lower() == "refresh":
            self.refresh = a.get("content")


def refs(html: str) -> Refs:
    parser = Refs()
    parser.feed(html)
    return parser


def build(tmp_path, web: WebConfig | None = None) -> tuple[Runtime, TestClient]:
    settings = ServerSettings(storage_path=str(tmp_path / "page.db"))
    transport = httpx.MockTransport(lambda r: httpx.Response(200, content=b'{"schema":1,"snapshots":[]}'))
    puller = Puller(
        StaticTargets(("10.0.0.3:9471", "10.0.0.9:9471")), transport=transport, parse=parse_dict, clock=lambda: 5000.0
    )
    runtime = Runtime(engine=StubEngine(), source=puller, store=AlertStore(settings.storage_path), clock=lambda: 5000.0)
    return runtime, TestClient(create_app(settings, runtime=runtime, run_pipeline=False, web=web))


JOB = {
    "hpc_job": "71002",
    "gpus": 16,
    "nodes": ["dgx-03", "dgx-04"],
    "utilization_ratio": 0.9,
    "sm_active_ratio": 0.61,
    "baseline_sm_active_ratio": 0.8,
    "power_watts": 500.0,
    "estimated_slowdown_ratio": 0.23,
    "stragglers": [{"node": "dgx-03", "gpu": 2}],
    "comm_bound": False,
    "input_bound": False,
    "comm_bound_share": 0.0,
    "evaluated_ticks": 300,
    "gpu_hours_lost": 0.12,
    "gpu_hours_lost_by_kind": {"straggler": 0.12},
}
CALM_JOB = {
    **JOB,
    "hpc_job": "71001",
    "nodes": ["dgx-01"],
    "stragglers": [],
    "gpu_hours_lost": 0.0,
    "gpu_hours_lost_by_kind": {},
    "estimated_slowdown_ratio": 0.0,
}


@pytest.fixture
def seeded(tmp_path):
    runtime, client = build(tmp_path)
    asyncio.run(runtime.source.pull_once())  # both agents answer
    straggler = make_alert(
        1, kind=AlertKind.STRAGGLER, severity=Severity.CRITICAL, node="dgx-03", gpu=2, hpc_job="71002"
    )
    resolved = make_alert(2, kind=AlertKind.COMM_BOUND, node=None, gpu=None, hpc_job="71002", state=AlertState.RESOLVED)
    runtime.store.upsert([straggler, resolved])
    runtime.view = FleetView(
        jobs=(JOB, CALM_JOB),
        evaluated_at=1100.0,
        nodes=(
            {"node": "dgx-03", "gpus": 8, "reachable": True, "hpc_jobs": ["71002"], "open_alerts": 1},
            {"node": "dgx-01", "gpus": 8, "reachable": True, "hpc_jobs": ["71001"], "open_alerts": 0},
        ),
    )
    return client, straggler, resolved


def test_overview_names_the_culprit_gpu_its_job_and_what_it_cost(seeded) -> None:
    client, straggler, resolved = seeded
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    # Fleet: 2 nodes, 16 GPUs, both agents up.
    assert ">2</b><span class=muted>nodes" in html and ">16</b><span class=muted>GPUs" in html
    assert "2 of 2</b><span class=muted>agents up" in html
    assert "<b>71002</b>" in html and "<b>71001</b>" in html
    assert "straggler dgx-03 GPU 2</a>" in html  # the job's health names the culprit and links its alert
    assert "dgx-03 GPU 2 (job 71002)" in html  # the firing alert's subject
    assert "23 %" in html and "slower than its baseline now" in html
    assert "straggler 0.12" in html  # GPU-hours lost, by kind
    assert "peers median <b>0.5</b>" in html  # the firing alert's evidence, inline
    links = refs(html).links
    assert f"/ui/alerts/{straggler.id}" in links and f"/ui/alerts/{resolved.id}" in links  # firing and recent
    assert "<span class=ok>ok</span>" in html  # the calm job


def test_alert_page_shows_the_whole_alert_and_links_its_json(seeded) -> None:
    client, straggler, _ = seeded
    page = client.get(f"/ui/alerts/{straggler.id}")
    assert page.status_code == 200
    html = page.text
    assert "straggler: dgx-03 GPU 2 (job 71002)" in html and "alert 1" in html
    assert "<th>n</th><td>1</td>" in html and "<th>peers median</th><td>0.5</td>" in html
    assert f"/alerts/{straggler.id}" in refs(html).links
    assert client.get(f"/alerts/{straggler.id}").json()["id"] == straggler.id  # the REST route stays JSON


def test_both_pages_show_evidence_with_labels_units_and_local_times_and_what_to_do(tmp_path) -> None:
    runtime, client = build(tmp_path)
    xid = replace(
        make_alert(3, kind=AlertKind.XID, severity=Severity.CRITICAL, node="node-a", gpu=6),
        evidence={
            "code": 79,
            "count": 2,
            "last_event_time": 1795808310.882114,
            "temperature_celsius": 86.4,
            "sm_active_ratio": 0.7,
            "gpu_hours_lost": 1.234,
        },
        advice="Drain it, or restart the job without it.",
    )
    runtime.routing = AlertRouting(runbook_url="https://runbooks.example/gpufleet/{kind}")
    runtime.store.upsert([xid])
    when = local_time(1795808310.882114)
    assert when.startswith(datetime.fromtimestamp(1795808310).strftime("%Y-%m-%d %H:%M:%S"))
    overview = client.get("/").text
    alert_page = client.get(f"/ui/alerts/{xid.id}").text
    for html in (overview, alert_page):
        assert "last_event_time" not in html and "1795808310" not in html
        assert "Drain it, or restart the job without it." in html
        assert "https://runbooks.example/gpufleet/xid" in refs(html).links
    assert f"last event <b>{when}</b>" in overview and "temperature <b>86 °C</b>" in overview
    assert f"<th>last event</th><td>{when}</td>" in alert_page
    assert "<th>SM activity</th><td>0.70</td>" in alert_page
    assert "<th>GPU-hours lost</th><td>1.23 GPU-hours</td>" in alert_page
    assert "<th>XID code</th><td>79</td>" in alert_page
    rest = client.get(f"/alerts/{xid.id}").json()
    assert rest["evidence"]["last_event_time"] == 1795808310.882114  # REST keeps the machine values
    assert rest["advice"] == "Drain it, or restart the job without it."


def test_unknown_alert_is_a_404_page(seeded) -> None:
    client, _, _ = seeded
    page = client.get("/ui/alerts/nope<b>")
    assert page.status_code == 404 and page.headers["content-type"].startswith("text/html")
    assert "no alert with id &#x27;nope&lt;b&gt;&#x27;" in page.text


def test_what_agents_report_is_escaped(tmp_path) -> None:
    runtime, client = build(tmp_path)
    evil = "<script>alert(1)</script>"
    alert = make_alert(1, node=evil, gpu=0, hpc_job='j"><img src=x>')
    runtime.store.upsert([alert])
    job = {**JOB, "hpc_job": evil, "nodes": [evil], "stragglers": [{"node": evil, "gpu": 0}]}
    runtime.view = FleetView(jobs=(job,), evaluated_at=1100.0)
    for path in ("/", f"/ui/alerts/{alert.id}"):
        html = client.get(path).text
        assert evil not in html and "<img src=x>" not in html, path
        assert "&lt;script&gt;" in html
        assert refs(html).loads == []


def test_before_the_first_evaluation_the_page_says_so(tmp_path) -> None:
    _, client = build(tmp_path)
    html = client.get("/").text
    assert "not evaluated yet" in html and "no job attributed yet" in html and "nothing firing" in html


def test_the_page_reloads_itself_every_pull_interval_and_loads_nothing(seeded) -> None:
    client, straggler, _ = seeded
    for path in ("/", f"/ui/alerts/{straggler.id}"):
        found = refs(client.get(path).text)
        assert found.refresh == "5" and found.loads == [], path  # inline CSS, no script, no external asset
        assert all(not urlsplit(link).netloc for link in found.links), found.links
    assert refresh_seconds(30.0) == 30 and refresh_seconds(0.5) == 5


def test_docs_loads_only_what_the_server_itself_serves(seeded) -> None:
    client, _, _ = seeded
    page = client.get("/docs")
    assert page.status_code == 200
    loads = refs(page.text).loads
    assert any(u.endswith(".js") for u in loads) and any(u.endswith(".css") for u in loads), loads
    for url in loads:
        assert not urlsplit(url).netloc and url.startswith("/"), url  # same origin: no CDN
        assert client.get(url).status_code == 200, url
    assert "/openapi.json" in page.text and client.get("/openapi.json").status_code == 200


@pytest.mark.parametrize("path", ["/", "/ui/alerts/x", "/docs", "/docs/assets/swagger-ui-bundle.js"])
def test_page_and_docs_want_the_apis_credentials(tmp_path, path) -> None:
    _, client = build(tmp_path, WebConfig(users={"grafana": HASH}))
    refused = client.get(path)
    assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Basic ")
    assert client.get(path, auth=("grafana", "wrong")).status_code == 401
    assert client.get(path, auth=("grafana", "s3cret")).status_code in (200, 404)


def test_agents_not_answering_are_listed_with_their_error(tmp_path) -> None:
    settings = ServerSettings(storage_path=str(tmp_path / "page.db"))

    def refuse(request: httpx.Request) -> httpx.Response:
        if request.url.host == "10.0.0.9":
            raise httpx.ConnectError("connection refused")
        return httpx.Response(200, content=b'{"schema":1,"snapshots":[]}')

    puller = Puller(
        StaticTargets(("10.0.0.3:9471", "10.0.0.9:9471")),
        transport=httpx.MockTransport(refuse),
        parse=parse_dict,
        clock=lambda: 5000.0,
    )
    runtime = Runtime(engine=StubEngine(), source=puller, store=AlertStore(settings.storage_path), clock=lambda: 5000.0)
    asyncio.run(puller.pull_once())
    html = TestClient(create_app(settings, runtime=runtime, run_pipeline=False)).get("/").text
    assert "1 of 2</b><span class=muted>agents up" in html
    section = html.split("Agents not answering", 1)[1]
    assert "10.0.0.9:9471" in section and "<td class=bad>down</td>" in section and "10.0.0.3:9471" not in section
