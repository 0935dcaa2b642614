"""What a lost GPU or a silent node means for the jobs on it, for the detectors that judge jobs: the
health detector's conclusions (Detection.halted, and the silent nodes' jobs in standout and idling)."""

from __future__ import annotations

import numpy as np

from gpufleet.server.alerts import AlertKind
from gpufleet.server.engine.detectors import Context, Outcome, job_groups
from gpufleet.server.engine.groups import INFERRED_JOB
from gpufleet.server.engine.tick import Tick


def halted(tick: Tick, context: Context, lost: Outcome) -> set[int]:
    """Groups of jobs with a lost GPU (found now, or a gpu_lost alert opened within the last
    lost_gpu_hang_seconds). Such a job hangs in its collective until it dies or NCCL times out:
    utilization high, activity gone job-wide. Nobody in it is a straggler and it is not comm- or
    input-bound; the lost GPU is the alert. A job still running after that has gone on without the
    GPU (an elastic restart under the same job id) and is judged again.

    Without attribution the job is unknown: it may span any unattributed node with GPUs of the lost
    one's model, so every fallback group of that model is taken as hung, if the lost GPU ran work
    (was busy within unattributed_idle_seconds before it was lost). The price: another unattributed
    job's straggler of that model goes unnamed for as long."""
    cfg, t, alerts = tick.config, tick.t, context.alerts
    subjects = alerts.open_subjects((AlertKind.GPU_LOST,), since=t - cfg.lost_gpu_hang_seconds)
    for fp, f in lost.findings.items():
        # An open alert speaks for its GPU: its job was known when it opened, while the GPU's later
        # findings carry none (a dead GPU reports no job).
        if alerts.opened(fp) is None:
            subjects[(f.hpc_job, f.node, f.gpu)] = t
    hung = job_groups(tick.registry, (job for job, _, _ in subjects))
    busy_t = context.last_busy_time
    for (job, node, gpu), opened in subjects.items():
        slot = tick.windows.slot_of.get((node, gpu)) if job is None else None
        if slot is not None and busy_t[slot] >= opened - cfg.unattributed_idle_seconds:
            hung |= _unattributed_hung(tick, context, slot)
    return hung


def _unattributed_hung(tick: Tick, context: Context, slot: int) -> set[int]:
    """The groups taken as hung by an unattributed GPU lost while busy: the inferred job it was last
    in, if any (its co-movement named its job), else every unattributed group of its model."""
    last_group, registry = context.last_group, tick.registry
    last = last_group[slot] if slot < len(last_group) else -1
    if last >= 0 and registry.kind(int(last)) == INFERRED_JOB:
        return {int(last)}
    return registry.fallback_groups(int(tick.windows.slot_model_id[slot]))


def jobs_on_silent_nodes(tick: Tick, context: Context, unreachable: Outcome) -> set[int]:
    """Groups of the jobs last seen on a node that stopped answering.

    A job missing a node's ranks is not judged as a whole: if the node crashed, the job hangs in its
    collective until NCCL's timeout, utilization high and SM activity gone (a comm_bound's signature,
    but node_unreachable is the alert); if only its agent stopped, what the job's other GPUs read is
    still not the whole job. New job-level findings wait, and one already open is not cleared. As for
    a lost GPU, a job still running lost_gpu_hang_seconds after the node went silent has gone on
    without it, and is judged again.
    """
    if not unreachable.findings:
        return set()
    w = tick.windows
    since = tick.t - tick.config.lost_gpu_hang_seconds
    nodes = []
    for fp, f in unreachable.findings.items():
        opened = context.alerts.opened(fp)
        if f.node in w.node_ids and (opened is None or opened >= since):
            nodes.append(w.node_ids[f.node])
    on = np.isin(w.slot_node_id[: w.n], nodes)
    return job_groups(tick.registry, (w.job_names[c] for c in set(w.slot_job[: w.n][on].tolist()) if c >= 0))
