"""`/nodes` and `/jobs`: the fleet as of the engine's latest evaluation."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter

from gpufleet.server.api.deps import RuntimeDep
from gpufleet.server.api.models import JobModel, JobsModel, NodeModel, NodesModel, TargetModel

router = APIRouter(tags=["fleet"])


@router.get("/nodes", response_model=NodesModel, summary="Nodes and agent targets")
async def list_nodes(runtime: RuntimeDep) -> NodesModel:
    """Every node the engine tracks and the health of every agent target."""
    view = runtime.view
    targets = [
        TargetModel.model_validate({k: v for k, v in asdict(h).items() if k in TargetModel.model_fields})
        for h in runtime.source.health()
    ]
    return NodesModel(
        nodes=[NodeModel.model_validate(n) for n in view.nodes],
        targets=targets,
        evaluated_at=view.evaluated_at,
        unjudged_gpus=int(view.stats.get("gpus_unjudged") or 0),
    )


@router.get("/jobs", response_model=JobsModel, summary="Per-job health")
async def list_jobs(runtime: RuntimeDep) -> JobsModel:
    """GPUs, stragglers and communication-bound share of every job."""
    view = runtime.view
    return JobsModel(jobs=[JobModel.model_validate(j) for j in view.jobs], evaluated_at=view.evaluated_at)
