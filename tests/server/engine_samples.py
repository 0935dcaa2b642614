"""Hand-built snapshot-contract samples for the engine's unit tests (no simulator, no randomness)."""

from __future__ import annotations

from typing import Any, Callable

import orjson

from gpufleet.agent.model import GpuSample, NodeSnapshot
from gpufleet.server.contract import NodeSample, parse_line

T0 = 1_763_800_000.0
MAX_HZ = 1.98e9

Override = Callable[[float, str, int], dict[str, Any]]


def healthy(index: int, job: str | None = "j1", **kw: Any) -> GpuSample:
    """A busy, cool, unthrottled H100 in a training job."""
    base: dict[str, Any] = dict(
        index=index,
        uuid=f"GPU-{index:04d}",
        model="NVIDIA H100",
        hpc_job=job,
        utilization_ratio=0.98,
        sm_active_ratio=0.80,
        temperature_celsius=60.0,
        slowdown_temperature_celsius=87.0,
        power_watts=500.0,
        power_limit_watts=700.0,
        sm_clock_hertz=MAX_HZ,
        sm_clock_max_hertz=MAX_HZ,
        throttle_reasons=0,
        xid_errors_total=0,
        ecc_uncorrected_errors_total=0,
        remapped_rows_pending=False,
        remapped_rows_failure=False,
    )
    base.update(kw)
    return GpuSample(**base)


def snapshot_line(node: str, t: float, gpus: list[GpuSample]) -> bytes:
    """One JSON line of the snapshot contract."""
    return orjson.dumps(NodeSnapshot(node=node, time=t, gpus=tuple(gpus)).to_dict())


def sample(node: str, t: float, gpus: list[GpuSample]) -> NodeSample:
    """A parsed NodeSample."""
    return parse_line(snapshot_line(node, t, gpus))


def cluster_lines(
    seconds: float,
    interval: float = 5.0,
    nodes: int = 2,
    gpus: int = 8,
    override: Override | None = None,
    job: str | None = "j1",
    t0: float = T0,
) -> list[bytes]:
    """Lines for `nodes` x `gpus` GPUs every `interval` s; override(t_rel, node, gpu) patches fields."""
    lines = []
    steps = int(seconds / interval)
    for k in range(steps):
        t_rel = k * interval
        for n in range(nodes):
            node = f"n{n}"
            row = []
            for g in range(gpus):
                kw = dict(override(t_rel, node, g)) if override else {}
                if kw.pop("_absent", False):
                    continue
                row.append(healthy(g, job=kw.pop("hpc_job", job), **kw))
            if row or not override:
                lines.append(snapshot_line(node, t0 + t_rel + 0.1 * n, row))
    return lines


def slow_gpu_from_400(t: float, node: str, gpu: int) -> dict[str, float]:
    """A cluster_lines override: from 400 s GPU n1/3 computes while its 15 peers wait for it (the engine's
    straggler)."""
    if t < 400:
        return {}
    if node == "n1" and gpu == 3:
        return {"sm_clock_hertz": 1.48e9, "sm_active_ratio": 0.80, "power_watts": 430.0}
    return {"sm_active_ratio": 0.62, "power_watts": 410.0}
