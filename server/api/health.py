"""`/healthz`: is the pipeline running, and how many agents answer."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from gpufleet.server.api.deps import RuntimeDep
from gpufleet.server.api.models import HealthModel

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=HealthModel, summary="Liveness and pipeline summary",
            responses={503: {"model": HealthModel}})
async def healthz(runtime: RuntimeDep) -> JSONResponse:
    """200 while cycles complete; 503 before the first cycle, when cycles stopped completing, or while alert
    changes wait for the store (a failed write, retried every cycle)."""
    health = runtime.puller.health()
    stats = runtime.stats
    last = stats.last_tick
    if last is None:
        status = "starting"
    elif runtime.clock() - last > max(3 * runtime.pull_interval_seconds, 30.0) or stats.store_unsaved_changes:
        status = "degraded"
    else:
        status = "ok"
    body = HealthModel(status=status, targets=len(health), targets_up=sum(1 for h in health if h.up),
                       cycles=stats.cycles_total, last_tick=last, open_alerts=len(runtime.view.alerts),
                       store_unsaved_changes=stats.store_unsaved_changes,
                       store_unsaved_age_seconds=None if stats.store_unsaved_since is None
                       else max(0.0, runtime.clock() - stats.store_unsaved_since))
    return JSONResponse(body.model_dump(), status_code=200 if status == "ok" else 503)
