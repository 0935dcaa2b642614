"""`/healthz`: is the pipeline running, and how many agents answer."""

from __future__ import annotations

from typing import Literal, Sequence

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from gpufleet.server.api.deps import RuntimeDep
from gpufleet.server.api.models import HealthModel
from gpufleet.server.ingest.base import TargetHealth

router = APIRouter(tags=["health"])


@router.get(
    "/healthz",
    response_model=HealthModel,
    summary="Liveness and pipeline summary",
    responses={503: {"model": HealthModel}},
)
async def healthz(runtime: RuntimeDep) -> JSONResponse:
    """200 while cycles complete; 503 before the first cycle or when cycles stopped completing. "degraded"
    with a reason also while alert changes wait for the store (a failed write, retried every cycle), while
    the store fails to read or write (a damaged file), or when the last cycle had no usable GPU sample
    (still 200), or while a target has been tried and never answered (still 200; the targets named)."""
    health = runtime.source.health()
    stats = runtime.stats
    last = stats.last_tick
    blind = runtime.source.blind
    silent = never_answered(health)
    reason = detail = None
    status: Literal["ok", "starting", "degraded"]
    if last is None:
        status = "starting"
    elif runtime.clock() - last > max(3 * runtime.pull_interval_seconds, 30.0):
        status, reason = "degraded", "stalled"
    elif stats.store_unsaved_changes or runtime.store.failing:
        # A read or write of the store failed and none of its kind has succeeded since (a full disk, a damaged
        # page): /alerts answers from the open alerts in memory meanwhile.
        status = "degraded"
        failing = [f"alert store {op} failed: {error}" for op, error in sorted(runtime.store.failing.items())]
        if stats.store_unsaved_changes:
            reason = "store_unsaved"
            failing.insert(0, f"{stats.store_unsaved_changes} alert changes wait for the store (retried every cycle)")
        else:
            reason = "store_error"
        detail = "; ".join(failing)
    elif blind is not None:
        # Cycles complete but see no GPU: "ok" here would hide a fleet nobody watches.
        status, reason = "degraded", blind.reason
        detail = f"looked for {blind.looked_for}; found {blind.found}"
    elif silent:
        # A typo'd host or a firewalled port answers nothing from the first pull: its node never appears,
        # so no node_unreachable names it. Here is the only place it shows.
        status, reason = "degraded", "targets_never_answered"
        detail = "; ".join(f"{h.target}: {h.last_error or 'no answer'}" for h in silent)
    else:
        status = "ok"
    body = HealthModel(
        status=status,
        targets=len(health),
        targets_up=sum(1 for h in health if h.up),
        cycles=stats.cycles_total,
        last_tick=last,
        open_alerts=len(runtime.view.alerts),
        targets_never_answered=[h.target for h in silent],
        degraded_reason=reason,
        degraded_detail=detail,
        store_unsaved_changes=stats.store_unsaved_changes,
        store_unsaved_age_seconds=None
        if stats.store_unsaved_since is None
        else max(0.0, runtime.clock() - stats.store_unsaved_since),
    )
    # Blind or unsaved is degraded but answers 200: the process works and a restart cannot bring back what it
    # reads or free the disk (it would lose the unsaved changes), so a liveness probe on /healthz must not
    # loop it; gpufleet_server_blind, gpufleet_server_store_unsaved_changes and the log say it instead.
    return JSONResponse(body.model_dump(), status_code=503 if status == "starting" or reason == "stalled" else 200)


def never_answered(health: Sequence[TargetHealth]) -> list[TargetHealth]:
    """Targets the source has tried and never heard from."""
    return [h for h in health if h.last_attempt is not None and h.last_success is None]
