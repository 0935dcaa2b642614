"""`/alerts`: filtered, paginated alert history and single alerts, read from the store."""

from __future__ import annotations

import sqlite3
from dataclasses import replace
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query
from starlette.concurrency import run_in_threadpool

from gpufleet.server.alerts import KIND_NAME, Alert, AlertKind, AlertState, Severity
from gpufleet.server.api.deps import PeersDep, RuntimeDep, Scope
from gpufleet.server.api.models import (
    AlertModel,
    AlertPageModel,
    ErrorModel,
    IncidentListModel,
    IncidentModel,
)
from gpufleet.server.api.peers import own_shard
from gpufleet.server.incidents import incidents
from gpufleet.server.runtime import Runtime
from gpufleet.server.store import MAX_PAGE, AlertQuery, query_open

router = APIRouter(tags=["alerts"])

_Name = Annotated[str | None, Query(min_length=1, max_length=256)]


@router.get("/alerts", response_model=AlertPageModel, summary="List alerts, newest first")
async def list_alerts(
    runtime: RuntimeDep,
    state: AlertState | None = None,
    kind: Annotated[
        str | None, Query(pattern=KIND_NAME.pattern, max_length=256, description="An alert kind, e.g. straggler")
    ] = None,
    severity: Severity | None = None,
    node: _Name = None,
    gpu: Annotated[int | None, Query(ge=0, le=1_000_000, description="GPU index on the node")] = None,
    hpc_job: _Name = None,
    incident: Annotated[str | None, Query(min_length=1, max_length=256, description="An incident id")] = None,
    since: Annotated[
        float | None,
        Query(
            ge=0,
            allow_inf_nan=False,
            description="Unix seconds: only alerts still open or resolved at or after this time",
        ),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
    scope: Scope = "shard",
    peers: PeersDep = None,
) -> AlertPageModel:
    """Alerts from the store matching every given filter: this shard's, or with scope=fleet (and
    --shard.peers) every shard's that answered, merged newest first."""
    if scope == "fleet" and peers is not None:
        filters: dict[str, Any] = {
            "state": state,
            "kind": kind,
            "severity": severity,
            "node": node,
            "gpu": gpu,
            "hpc_job": hpc_job,
        }
        filters |= {"incident": incident, "since": since}
        params = {k: (v.value if hasattr(v, "value") else v) for k, v in filters.items() if v is not None}
        # Each shard's first offset+limit alerts hold the fleet's page.
        first = min(offset + limit, MAX_PAGE)
        own = await list_alerts(runtime, **filters, limit=first)
        return await peers.fleet(
            own, "/alerts", {**params, "limit": first}, AlertPageModel, lambda parts: _merge_pages(parts, limit, offset)
        )
    query = AlertQuery(
        state=state,
        kind=None if kind is None else AlertKind(kind),
        severity=severity,
        node=node,
        gpu=gpu,
        hpc_job=hpc_job,
        incident=incident,
        since=since,
        limit=limit,
        offset=offset,
    )
    try:
        page = await run_in_threadpool(runtime.store.query, query)
    except sqlite3.Error:
        # The store fails (a damaged page; /healthz says so): the open alerts are in memory, and are what matters.
        page = query_open(runtime.view.alerts, query)
    end = offset + len(page.alerts)
    return AlertPageModel(
        alerts=[AlertModel.of(_linked(runtime, a)) for a in page.alerts],
        total=page.total,
        limit=limit,
        offset=offset,
        next_offset=end if end < page.total else None,
        shard=own_shard(runtime.shard),
    )


def _merge_pages(parts: list[AlertPageModel], limit: int, offset: int) -> AlertPageModel:
    """One page of every shard's alerts, newest first as the store orders them."""
    alerts = sorted((a for p in parts for a in p.alerts), key=lambda a: (-a.pending_since, a.id))
    total = sum(p.total for p in parts)
    page = alerts[offset : offset + limit]
    end = offset + len(page)
    return AlertPageModel(
        alerts=page, total=total, limit=limit, offset=offset, next_offset=end if end < total else None
    )


@router.get(
    "/alerts/{alert_id}",
    response_model=AlertModel,
    summary="One alert occurrence",
    responses={404: {"model": ErrorModel}, 503: {"model": ErrorModel}},
)
async def get_alert(runtime: RuntimeDep, alert_id: str) -> AlertModel:
    """An alert by id; 404 when unknown (or pruned from history); 503 when only the store could say."""
    try:
        alert = await run_in_threadpool(runtime.store.get, alert_id)
    except sqlite3.Error as exc:
        alert = next((a for a in runtime.view.alerts if a.id == alert_id), None)
        if alert is None:
            raise HTTPException(status_code=503, detail=f"alert store unavailable: {exc}") from None
    if alert is None:
        raise HTTPException(status_code=404, detail=f"no alert with id {alert_id!r}")
    return AlertModel.of(_linked(runtime, alert))


@router.get("/incidents", response_model=IncidentListModel, summary="Open incidents: each cause and its effects")
async def list_incidents(runtime: RuntimeDep, peers: PeersDep = None, scope: Scope = "shard") -> IncidentListModel:
    """The open alerts grouped by cause, as of the engine's latest evaluation; a cause that resolved while
    its effects stay open is read from the store. This shard's, or with scope=fleet (and --shard.peers) every
    shard's that answered, newest cause first (each shard groups the alerts it owns)."""
    listed = []
    for i in incidents(runtime.view.alerts):
        cause = i.cause
        if cause is None:
            try:
                cause = await run_in_threadpool(runtime.store.get, i.id)
            except sqlite3.Error:
                cause = None  # the store fails (/healthz says so): the effects are what is open
        listed.append(
            IncidentModel(
                id=i.id,
                cause=None if cause is None else AlertModel.of(_linked(runtime, cause)),
                effects=[AlertModel.of(_linked(runtime, e)) for e in i.effects],
            )
        )
    own = IncidentListModel(incidents=listed, shard=own_shard(runtime.shard))
    if scope == "shard" or peers is None:
        return own
    return await peers.fleet(own, "/incidents", {}, IncidentListModel, _merge_incidents)


def _merge_incidents(parts: list[IncidentListModel]) -> IncidentListModel:
    """Every shard's incidents, newest first by cause (else first effect), as each shard orders its own."""

    def newest_first(incident: IncidentModel) -> tuple[float, str]:
        first = incident.cause or (incident.effects[0] if incident.effects else None)
        return (-(first.pending_since if first is not None else 0.0), incident.id)

    return IncidentListModel(incidents=sorted((i for p in parts for i in p.incidents), key=newest_first))


def _linked(runtime: Runtime, alert: Alert) -> Alert:
    """The alert with its runbook link: the store keeps none, the link is the server's setting now."""
    return alert if alert.runbook_url else replace(alert, runbook_url=runtime.routing.runbook(alert))
