"""The status page at `/` and each alert's own page at `/ui/alerts/{id}`: HTML for a person.

Built from what the JSON routes answer (their functions and models), so the page and the API cannot
tell two stories; the pictures come from the runtime's chart history (server/history.py), drawn as
inline SVG by server/api/charts.py. Self-contained: inline CSS, no script, no external asset, so it works air-gapped;
it reloads itself every pull interval. Every value from agents or the store is escaped.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone, tzinfo
from html import escape
from typing import Any, Iterable
from urllib.parse import quote

from fastapi import APIRouter, HTTPException
from fastapi.responses import HTMLResponse

from gpufleet.server.alerts import AlertState, IncidentRole
from gpufleet.server.api import alerts as alert_routes
from gpufleet.server.api import charts, evidence
from gpufleet.server.api import fleet as fleet_routes
from gpufleet.server.api.deps import PeersDep, RuntimeDep, Scope
from gpufleet.server.api.models import AlertModel, AlertPageModel, JobModel, JobsModel, NodesModel
from gpufleet.server.history import AlertChart, Charts

router = APIRouter(include_in_schema=False)

FIRING_SHOWN = 100
RECENT_SHOWN = 30
MIN_REFRESH_SECONDS = 5
JOB_CHARTS_SHOWN = 100  # jobs drawn with their last hour; past it the table goes on without pictures

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1d2329;background:#f5f6f8}
header{background:#1d2b3a;color:#fff;padding:10px 24px;display:flex;gap:24px;align-items:baseline;flex-wrap:wrap}
header h1{font-size:18px;margin:0}header a{color:#cfe3ff}main{max-width:1280px;margin:0 auto;padding:8px 24px 32px}
h2{font-size:16px;margin:22px 0 8px}table{border-collapse:collapse;width:100%;background:#fff}
th,td{text-align:left;padding:5px 8px;border-bottom:1px solid #e3e6ea;vertical-align:top}
th{background:#eef0f3;font-weight:600;white-space:nowrap}td.n{text-align:right;font-variant-numeric:tabular-nums}
.cards{display:flex;gap:12px;flex-wrap:wrap}
.card{background:#fff;border:1px solid #e3e6ea;padding:8px 14px;min-width:120px}
.card b{display:block;font-size:22px}.muted{color:#66707a}.ok{color:#1a7f37}.bad{color:#b42318;font-weight:600}
.sev-critical{color:#fff;background:#b42318;padding:1px 6px;border-radius:3px}
.sev-warning{color:#1d2329;background:#f5c451;padding:1px 6px;border-radius:3px}
.sev-info{color:#fff;background:#55708c;padding:1px 6px;border-radius:3px}
.ev{font-size:12px;color:#3d4650;margin-top:3px}.ev span{margin-right:12px;white-space:nowrap}
dl{display:grid;grid-template-columns:max-content 1fr;gap:4px 16px;background:#fff;padding:10px 14px;margin:0}
tr.effect td{background:#f7f8fa;color:#3d4650}tr.effect td:nth-child(2){padding-left:22px}
.todo{margin:4px 0;font-size:13px}.nw{white-space:nowrap}dt{font-weight:600}dd{margin:0}code{font-size:12px}
.charts{display:flex;gap:12px;flex-wrap:wrap}figure{margin:0;background:#fff;border:1px solid #e3e6ea;padding:8px}
figcaption{font-size:12px;color:#3d4650;max-width:640px}.chart .lbl{font-size:11px;fill:#3d4650}
.chart .axis{font-size:12px;fill:#1d2329}td svg{display:block}
"""


@router.get("/", response_class=HTMLResponse)
async def overview(runtime: RuntimeDep, peers: PeersDep = None, scope: Scope = "shard") -> HTMLResponse:
    """Fleet summary, jobs, firing and recent alerts: this shard's, or every shard's with scope=fleet."""
    nodes = await fleet_routes.list_nodes(runtime, peers, scope)
    jobs = await fleet_routes.list_jobs(runtime, peers, scope)
    firing = await alert_routes.list_alerts(
        runtime, state=AlertState.FIRING, limit=FIRING_SHOWN, scope=scope, peers=peers
    )
    recent = await alert_routes.list_alerts(runtime, limit=RECENT_SHOWN, scope=scope, peers=peers)
    refresh = refresh_seconds(runtime.pull_interval_seconds)
    return HTMLResponse(render_overview(nodes, jobs, firing, recent, refresh, charts=runtime.view.charts))


@router.get("/ui/alerts/{alert_id}", response_class=HTMLResponse)
async def alert_page(runtime: RuntimeDep, alert_id: str) -> HTMLResponse:
    """One alert with all its evidence; a 404 page when unknown."""
    refresh = refresh_seconds(runtime.pull_interval_seconds)
    try:
        alert = await alert_routes.get_alert(runtime, alert_id)
    except HTTPException as exc:
        return HTMLResponse(
            _document("alert not found", refresh, f"<p>{escape(str(exc.detail))}</p>"), status_code=exc.status_code
        )
    chart = runtime.view.charts.alerts.get(alert.id)
    return HTMLResponse(render_alert(alert, runtime.view.evaluated_at, refresh, chart=chart))


def refresh_seconds(pull_interval_seconds: float) -> int:
    """How often the page reloads: every pull interval, but no more than every few seconds."""
    return max(MIN_REFRESH_SECONDS, math.ceil(pull_interval_seconds))


def render_overview(
    nodes: NodesModel,
    jobs: JobsModel,
    firing: AlertPageModel,
    recent: AlertPageModel,
    refresh: int,
    *,
    charts: Charts | None = None,
    tz: tzinfo | None = None,
) -> str:
    """The `/` page; `tz` is the zone the pictures' times are in (None: the server's)."""
    now = jobs.evaluated_at if jobs.evaluated_at is not None else nodes.evaluated_at
    pictures = charts or Charts()
    body = [
        _shard(jobs, firing, nodes),
        _fleet(nodes, firing.total, now),
        _fleet_view(pictures),
        _jobs(jobs.jobs, firing.alerts, pictures, tz),
        _firing(firing, now),
        _recent([a for a in recent.alerts if a.state is not AlertState.FIRING]),
    ]
    return _document("gpufleet", refresh, "".join(body), now)


def render_alert(
    alert: AlertModel, now: float | None, refresh: int, *, chart: AlertChart | None = None, tz: tzinfo | None = None
) -> str:
    """The `/ui/alerts/{id}` page; `chart` its subject against its peers, `tz` the pictures' zone."""
    facts = [
        ("state", _state(alert)),
        ("severity", _severity(alert.severity.value)),
        ("kind", escape(alert.kind)),
        ("subject", escape(subject(alert))),
        ("GPU UUID", escape(alert.uuid or "-")),
        ("job", escape(alert.hpc_job or "-")),
        ("cause", escape(alert.cause or "-")),
        ("incident", _incident(alert)),
        ("pending since", _time(alert.pending_since)),
        ("firing since", _time(alert.started)),
        ("resolved", _time(alert.resolved)),
        ("updated", _time(alert.updated)),
        ("id", f'<code>{escape(alert.id)}</code> (<a href="/alerts/{_path(alert.id)}">JSON</a>)'),
    ]
    if alert.state is AlertState.FIRING and alert.started is not None and now is not None:
        facts.insert(1, ("firing for", escape(_duration(now - alert.started))))
    rows = "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in evidence.rows(alert.evidence))
    body = (
        f"<h2>{escape(alert.kind)}: {escape(subject(alert))}</h2><p>{escape(alert.summary)}</p>"
        f"{_what_to_do(alert)}"
        f"<dl>{''.join(f'<dt>{k}</dt><dd>{v}</dd>' for k, v in facts)}</dl>"
        + _alert_charts(alert, chart, tz)
        + "<h2>Evidence</h2>"
        + (f"<table>{rows}</table>" if rows else "<p class=muted>none</p>")
        + '<p><a href="/">&larr; status page</a></p>'
    )
    return _document(f"{alert.kind}: {subject(alert)}", refresh, body, now)


def subject(alert: AlertModel) -> str:
    """What the alert is about, as a person names it: `dgx-03 GPU 2 (job 71002)`, a node, or a job."""
    if alert.node is None:
        return f"job {alert.hpc_job}" if alert.hpc_job else "-"
    where = alert.node if alert.gpu is None else f"{alert.node} GPU {alert.gpu}"
    return f"{where} (job {alert.hpc_job})" if alert.hpc_job else where


def _shard(jobs: JobsModel, firing: AlertPageModel, nodes: NodesModel) -> str:
    """Which part of a sharded fleet the page shows, and which shards' parts a fleet view lacks."""
    shard = jobs.shard
    if shard.count == 1:
        return ""
    if jobs.scope == "shard":
        return (
            f"<p>Shard <b>{shard.index}/{shard.count}</b>: the jobs and alerts of this shard's part of the fleet "
            '(<a href="/?scope=fleet">the whole fleet</a>, from every shard).</p>'
        )
    views = (jobs, firing, nodes)
    missing = sorted({i for v in views for i in v.shards_missing})
    failed = {e.peer: e.error for v in views for e in v.peer_errors}
    lines = [
        f"<p>The nodes, jobs and alerts of the whole fleet, as every shard answered this server (shard "
        f"{shard.index}/{shard.count}).</p>"
    ]
    if missing:
        lines.append(
            f"<p class=bad>Not shown: shard{'s' if len(missing) > 1 else ''} "
            f"{escape(', '.join(map(str, missing)))} did not answer.</p>"
        )
    lines += [f"<p class=bad>{escape(peer)}: {escape(error)}</p>" for peer, error in failed.items()]
    return "".join(lines)


def _fleet(nodes: NodesModel, firing_total: int, now: float | None) -> str:
    targets = nodes.targets
    up = sum(1 for t in targets if t.up)
    cards = [
        ("nodes", str(len(nodes.nodes))),
        ("GPUs", str(sum(n.gpus or 0 for n in nodes.nodes))),
        ("agents up", f"{up} of {len(targets)}"),
        ("alerts firing", str(firing_total)),
        ("busy GPUs unjudged", str(nodes.unjudged_gpus)),
    ]
    html = [
        "<h2>Fleet</h2><div class=cards>",
        *(f"<div class=card><b>{escape(v)}</b><span class=muted>{escape(k)}</span></div>" for k, v in cards),
        "</div>",
    ]
    blind = [n for n in nodes.nodes if n.unjudged_gpus]
    if blind:
        rows = "".join(f"<tr><td>{escape(n.node or '-')}</td><td class=n>{n.unjudged_gpus}</td></tr>" for n in blind)
        html.append(
            "<h2>Busy GPUs without peers</h2><p class=muted>No peer group (job, inferred job, GPUs of the node)"
            " holds enough busy GPUs to compare these with: no straggler can be named among them.</p>"
            f"<table><tr><th>node</th><th>unjudged GPUs</th></tr>{rows}</table>"
        )
    down = [t for t in targets if not t.up or t.stale]
    if down:
        rows = "".join(
            f"<tr><td>{escape(t.target)}</td><td>{escape(t.node or '-')}</td>"
            f"<td class=bad>{'stale' if t.up else 'down'}</td><td class=n>{t.consecutive_failures}</td>"
            f"<td>{escape(t.last_error or '-')}</td><td>{_ago(t.last_success, now)}</td></tr>"
            for t in down
        )
        html.append(
            "<h2>Agents not answering</h2><table><tr><th>agent</th><th>node</th><th>state</th>"
            f"<th>failures</th><th>last error</th><th>last success</th></tr>{rows}</table>"
        )
    return "".join(html)


def _alert_charts(alert: AlertModel, chart: AlertChart | None, tz: tzinfo | None) -> str:
    """The subject's readings against its peers', the alert's times marked."""
    head = "<h2>Readings against its peers</h2>"
    if chart is None or not chart.series:
        return head + "<p class=muted role=note>no data: the engine holds no readings of this subject now</p>"
    who = None if alert.gpu is None or alert.node is None else f"{alert.node} GPU {alert.gpu}"
    marks = [
        (t, label)
        for t, label in ((alert.pending_since, "pending"), (alert.started, "firing"), (alert.resolved, "resolved"))
        if t is not None
    ]
    figures = "".join(f"<figure>{charts.time_chart(s, subject=who, marks=marks, tz=tz)}</figure>" for s in chart.series)
    peers = (
        f"its job's other {chart.series[0].peers} GPUs"
        if alert.hpc_job
        else f"the node's other {chart.series[0].peers} GPUs"
    )
    note = f"Peers: {peers}."
    if chart.window_start is not None:
        note += (
            f" From {escape(_clock(chart.window_start, tz))} on, each point is one of the engine's bins;"
            " before it, one-minute means."
        )
    return f"{head}<div class=charts>{figures}</div><p class=muted>{note}</p>"


def _fleet_view(pictures: Charts) -> str:
    """Every GPU now (or every node, past a size), by temperature and by SM activity against its job."""
    cells = pictures.fleet
    if not cells:
        return ""
    per_node = pictures.fleet_per_node
    grids = "".join(
        f"<figure><figcaption>{caption}</figcaption>{charts.fleet_grid(cells, colour_by=by, per_node=per_node)}</figure>"
        for by, caption in (("temperature", "Temperature"), ("relative", "SM activity over its job's median"))
    )
    note = (
        f"One square per node ({sum(c.gpus for c in cells)} GPUs are more than a page shows one by one):"
        " each shows its hottest GPU and the GPU farthest from its job's median."
        if per_node
        else "One square per GPU, a row per node."
    )
    return (
        "<h2>GPUs now</h2><div class=charts>"
        + grids
        + f"</div><p class=muted>{note} A straggler computes while its peers"
        " wait, so its SM activity stands out above its job's median; a GPU that idles stands out below it."
        " Hover a square for its numbers.</p>"
    )


def _jobs(jobs: list[JobModel], firing: list[AlertModel], pictures: Charts, tz: tzinfo | None) -> str:
    if not jobs:
        return "<h2>Jobs</h2><p class=muted>no job attributed yet</p>"
    head = (
        '<tr><th>job</th><th>GPUs</th><th>nodes</th><th>SM activity</th><th title="The median of the job\'s GPUs and their 25th-75th percentile, one-minute means">'
        "SM activity, last hour</th>"
        "<th title=\"The job's step-time slowdown now, read from its GPUs' activity against the job's own "
        'baseline">slower than its baseline now</th><th>GPU-hours lost</th><th>health</th></tr>'
    )
    rows = []
    for i, job in enumerate(jobs):
        series = pictures.jobs.get(job.hpc_job or "") if i < JOB_CHARTS_SHOWN else None
        picture = charts.job_chart(series, job=job.hpc_job or "-", tz=tz) if series else "<span class=muted>-</span>"
        sm = _ratio(job.sm_active_ratio)
        if job.baseline_sm_active_ratio is not None:
            sm += f" <span class=muted>(baseline {_ratio(job.baseline_sm_active_ratio)})</span>"
        lost = _hours(job.gpu_hours_lost)
        if job.gpu_hours_lost_by_kind:
            lost += (
                " <span class=muted>("
                + ", ".join(f"{escape(k)} {_hours(v)}" for k, v in sorted(job.gpu_hours_lost_by_kind.items()))
                + ")</span>"
            )
        rows.append(
            f"<tr><td><b>{escape(job.hpc_job or '-')}</b></td><td class=n>{job.gpus or 0}</td>"
            f"<td>{escape(', '.join(job.nodes))}</td><td>{sm}</td><td>{picture}</td>"
            f"<td class=n>{_percent(job.estimated_slowdown_ratio)}</td><td>{lost}</td>"
            f"<td>{_health(job, firing)}</td></tr>"
        )
    return f"<h2>Jobs</h2><table>{head}{''.join(rows)}</table>"


def _health(job: JobModel, firing: list[AlertModel]) -> str:
    """What holds a job back now, each straggler linked to its alert."""
    parts = []
    for ref in job.stragglers:
        where = ref.node if ref.gpu is None else f"{ref.node} GPU {ref.gpu}"
        alert = next(
            (
                a
                for a in firing
                if a.kind == "straggler" and a.hpc_job == job.hpc_job and a.node == ref.node and a.gpu == ref.gpu
            ),
            None,
        )
        text = f"straggler {escape(where or '-')}"
        parts.append(
            f'<a class=bad href="{_alert_href(alert)}">{text}</a>' if alert else f"<span class=bad>{text}</span>"
        )
    parts += [f"<span class=bad>{flag}</span>" for flag in ("comm_bound", "input_bound") if getattr(job, flag)]
    return ", ".join(parts) or "<span class=ok>ok</span>"


def _firing(page: AlertPageModel, now: float | None) -> str:
    if not page.alerts:
        return "<h2>Firing alerts</h2><p class=ok>nothing firing</p>"
    shown = len(page.alerts)
    more = f" <span class=muted>(newest {shown} of {page.total})</span>" if page.total > shown else ""
    rows = "".join(
        f"<tr{' class=effect' if effect else ''}><td>{_severity(a.severity.value)}</td>"
        f"<td>{'&#8627; ' if effect else ''}{escape(a.kind)}</td>"
        f'<td class=nw><a href="{_alert_href(a)}"><b>{escape(subject(a))}</b></a></td>'
        f"<td>{_ago(a.started, now, suffix='')}</td>"
        f"<td>{escape(a.summary)}{_what_to_do(a)}<div class=ev>{_evidence_line(a.evidence)}</div></td></tr>"
        for a, effect in by_incident(page.alerts)
    )
    return (
        f"<h2>Firing alerts ({page.total}){more}</h2><table><tr><th>severity</th><th>kind</th><th>subject</th>"
        f"<th>for</th><th>summary and evidence</th></tr>{rows}</table>"
    )


def by_incident(alerts: list[AlertModel]) -> list[tuple[AlertModel, bool]]:
    """The alerts with each cause's effects right under it, as (alert, is an effect shown under its cause);
    an effect whose cause is not among them keeps its place."""
    listed = {a.id for a in alerts}
    under: dict[str, list[AlertModel]] = {}
    for a in alerts:
        if a.role is IncidentRole.EFFECT and a.incident in listed and a.incident != a.id:
            under.setdefault(a.incident, []).append(a)
    placed = {e.id for effects in under.values() for e in effects}
    out: list[tuple[AlertModel, bool]] = []
    for a in alerts:
        if a.id not in placed:
            out += [(a, False)] + [(e, True) for e in under.get(a.id, ())]
    return out


def _recent(recent: Iterable[AlertModel]) -> str:
    rows = "".join(
        f"<tr><td>{_time(a.updated)}</td><td>{_state(a)}</td><td>{escape(a.kind)}</td>"
        f'<td><a href="{_alert_href(a)}">{escape(subject(a))}</a></td><td>{escape(a.summary)}</td></tr>'
        for a in recent
    )
    if not rows:
        return "<h2>Recent alerts</h2><p class=muted>none besides those firing</p>"
    return (
        "<h2>Recent alerts</h2><table><tr><th>updated</th><th>state</th><th>kind</th><th>subject</th>"
        f"<th>summary</th></tr>{rows}</table>"
    )


def _document(title: str, refresh: int, body: str, now: float | None = None) -> str:
    when = "not evaluated yet" if now is None else f"evaluated {_time(now)}"
    return (
        f"<!doctype html><html lang=en><head><meta charset=utf-8>"
        f'<meta name=viewport content="width=device-width,initial-scale=1">'
        f'<meta http-equiv=refresh content="{refresh}"><title>{escape(title)}</title><style>{_CSS}</style>'
        f'</head><body><header><h1><a href="/" style="color:#fff;text-decoration:none">gpufleet</a></h1>'
        f'<span>{when}</span><a href="/docs">API</a><a href="/alerts">alerts JSON</a>'
        f'<a href="/metrics">metrics</a></header><main>{body}</main></body></html>'
    )


def _evidence_line(values: dict[str, Any]) -> str:
    """Scalar evidence as `label value` pairs with units, for the overview; the alert's page shows all of it."""
    # Spaces between the pairs: the line wraps there instead of widening the table past the screen.
    scalars = {k: v for k, v in values.items() if v is None or isinstance(v, (str, int, float, bool))}
    return " ".join(f"<span>{escape(k)} <b>{escape(v)}</b></span>" for k, v in evidence.rows(scalars))


def _what_to_do(alert: AlertModel) -> str:
    """The advice of the alert's kind and its runbook link, where there are any."""
    parts = []
    if alert.advice:
        parts.append(f"<b>What to do:</b> {escape(alert.advice)}")
    if alert.runbook_url:
        parts.append(f'<a href="{escape(alert.runbook_url)}">runbook</a>')
    return f"<p class=todo>{' '.join(parts)}</p>" if parts else ""


def _incident(alert: AlertModel) -> str:
    """Its role in its incident, linked to the cause where it is an effect."""
    if alert.incident is None or alert.role is None:
        return "-"
    members = f'<a href="/alerts?incident={quote(alert.incident, safe="")}">its alerts, JSON</a>'
    if alert.role is IncidentRole.CAUSE:
        return f"the cause: what pages ({members})"
    cause = f'<a href="/ui/alerts/{_path(alert.incident)}">{escape(alert.incident)}</a>'
    return f"effect of {cause} ({members})"


def _state(alert: AlertModel) -> str:
    return f"<span class={'bad' if alert.state is AlertState.FIRING else 'muted'}>{escape(alert.state.value)}</span>"


def _severity(value: str) -> str:
    return f"<span class=sev-{escape(value)}>{escape(value)}</span>"


def _alert_href(alert: AlertModel) -> str:
    return f"/ui/alerts/{_path(alert.id)}"


def _path(segment: str) -> str:
    return escape(quote(segment, safe=""))


def _time(t: float | None) -> str:
    if t is None:
        return "-"
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _clock(t: float, tz: tzinfo | None) -> str:
    when = datetime.fromtimestamp(t, tz) if tz is not None else datetime.fromtimestamp(t).astimezone()
    return when.strftime("%H:%M:%S %Z").strip()


def _ago(t: float | None, now: float | None, suffix: str = " ago") -> str:
    if t is None:
        return "-"
    if now is None:
        return _time(t)
    return escape(_duration(now - t)) + suffix


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m {seconds % 60:02d}s"
    return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _percent(value: float | None) -> str:
    # Rounded as an int: a job a hair faster than its baseline reads "0 %", not "-0 %".
    return "-" if value is None else f"{round(value * 100)} %"


def _hours(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
