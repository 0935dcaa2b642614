"""`/nodes` and `/jobs`: the fleet as of the engine's latest evaluation."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter

from gpufleet.server.api.deps import PeersDep, RuntimeDep, Scope
from gpufleet.server.api.models import JobModel, JobsModel, NodeModel, NodesModel, TargetModel
from gpufleet.server.api.peers import own_shard

router = APIRouter(tags=["fleet"])


@router.get("/nodes", response_model=NodesModel, summary="Nodes and agent targets")
async def list_nodes(runtime: RuntimeDep, peers: PeersDep = None, scope: Scope = "shard") -> NodesModel:
    """Every node the engine tracks and the health of every agent target: this shard's, or with scope=fleet
    (and --shard.peers) every shard's that answered."""
    view = runtime.view
    targets = [
        TargetModel.model_validate({k: v for k, v in asdict(h).items() if k in TargetModel.model_fields})
        for h in runtime.source.health()
    ]
    own = NodesModel(
        nodes=[NodeModel.model_validate(n) for n in view.nodes],
        targets=targets,
        evaluated_at=view.evaluated_at,
        shard=own_shard(runtime.shard),
        unjudged_gpus=int(view.stats.get("gpus_unjudged") or 0),
    )
    if scope == "shard" or peers is None:
        return own
    return await peers.fleet(own, "/nodes", {}, NodesModel, _merge_nodes)


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


def _merge_nodes(parts: list[NodesModel]) -> NodesModel:
    """Every shard's nodes, by name, a node split between shards (GPUs of jobs that hash apart) as one; each
    agent target once; the evaluation time of the shard furthest behind."""
    by_name: dict[str | None, list[NodeModel]] = {}
    for node in (n for p in parts for n in p.nodes):
        by_name.setdefault(node.node, []).append(node)
    targets = {t.target: t for p in reversed(parts) for t in p.targets}  # the lowest shard's answer kept
    times = [p.evaluated_at for p in parts if p.evaluated_at is not None]
    return NodesModel(
        nodes=[_joined(by_name[name]) for name in sorted(by_name, key=lambda n: n or "")],
        targets=sorted(targets.values(), key=lambda t: t.target),
        evaluated_at=min(times) if times else None,
        unjudged_gpus=sum(p.unjudged_gpus for p in parts),
    )


def _joined(views: list[NodeModel]) -> NodeModel:
    """One node from the shards' views of it: its GPUs and open alerts added up, reachable where every shard
    reaches it, its newest sample the newest any shard has."""
    if len(views) == 1:
        return views[0]
    lags = [v.lag_seconds for v in views if v.lag_seconds is not None]
    times = [v.last_sample_time for v in views if v.last_sample_time is not None]
    reachable = [v.reachable for v in views if v.reachable is not None]
    return views[0].model_copy(
        update={
            "gpus": sum(v.gpus or 0 for v in views),
            "reachable": all(reachable) if reachable else None,
            "last_sample_time": max(times) if times else None,
            "lag_seconds": min(lags) if lags else None,
            "hpc_jobs": sorted({j for v in views for j in v.hpc_jobs}),
            "open_alerts": sum(v.open_alerts or 0 for v in views),
            "unjudged_gpus": sum(v.unjudged_gpus or 0 for v in views),
        }
    )
