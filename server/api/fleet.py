"""`/nodes` and `/jobs`: the fleet as of the engine's latest evaluation."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter

from gpufleet.server.api.deps import PeersDep, RuntimeDep, Scope
from gpufleet.server.api.models import JobModel, JobsModel, NodeModel, NodesModel, TargetModel
from gpufleet.server.api.peers import own_shard

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
        shard=own_shard(runtime.shard),
    )


@router.get("/jobs", response_model=JobsModel, summary="Per-job health")
async def list_jobs(runtime: RuntimeDep, peers: PeersDep = None, scope: Scope = "shard") -> JobsModel:
    """GPUs, stragglers and communication-bound share of every job this shard owns, or with scope=fleet
    (and --shard.peers) of every shard's that answered."""
    view = runtime.view
    own = JobsModel(
        jobs=[JobModel.model_validate(j) for j in view.jobs],
        evaluated_at=view.evaluated_at,
        shard=own_shard(runtime.shard),
    )
    if scope == "shard" or peers is None:
        return own
    return await peers.fleet(own, "/jobs", {}, JobsModel, _merge_jobs)


def _merge_jobs(parts: list[JobsModel]) -> JobsModel:
    """Every shard's jobs, by id; the evaluation time of the shard furthest behind."""
    times = [p.evaluated_at for p in parts if p.evaluated_at is not None]
    jobs = sorted((j for p in parts for j in p.jobs), key=lambda j: j.hpc_job or "")
    return JobsModel(jobs=jobs, evaluated_at=min(times) if times else None)
