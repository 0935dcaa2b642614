"""The finding that names one culprit GPU: its estimated slowdown, cost, evidence and wording, each built
on its own and assembled by gpu_finding."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from gpufleet.server.alerts import AlertKind, Severity
from gpufleet.server.engine.config import SECONDS_PER_HOUR
from gpufleet.server.engine.units import SECONDS_PER_MINUTE
from gpufleet.server.engine.detectors import Finding, r3, subject_fingerprint
from gpufleet.server.engine.detectors.straggler.common import CLK, PW, SM, UTIL, percent
from gpufleet.server.engine.detectors.straggler.gpus import SharedNode
from gpufleet.server.engine.detectors.straggler.state import StragglerState
from gpufleet.server.engine.groups import JOB
from gpufleet.server.engine.inference import inferred_peers, inferred_suffix
from gpufleet.server.engine.tick import THROTTLE_CAUSES, SlowdownSource, Tick, throttle_causes


def gpu_finding(
    tick: Tick,
    state: StragglerState,
    slot: int,
    ex: np.ndarray,
    dev: np.ndarray,
    cross: bool = False,
    idle: bool = False,
    shared: SharedNode | None = None,
    step: tuple[float, float, bool] | None = None,
) -> Finding:
    """The finding for one culprit GPU (ex, dev: its excess and deviation per row; cross: it stands out
    with no baseline needed; idle: it idles on its host while its peers wait; shared: found by
    gpus.shared_node, against the GPUs of its node that sank; step: its rise and its job's fall where
    steps.py found its standing stepped up, and whether against its node's GPUs rather than its group)."""
    cfg, w = tick.config, tick.windows
    gid = int(tick.groups.gid[slot])
    job = tick.registry.job(gid)
    waiting_peers = _waiting_peers(tick, slot, gid, shared)
    clocks_cut = tick.med["slow"][slot] >= cfg.straggler_slow_bits_share and -dev[CLK] > 0.0
    slowdown = _slowdown(tick, slot, gid, ex, dev, cross, idle, clocks_cut, shared)
    if step is not None:
        # The job's fall as it stepped is its peers' wait, where the baseline (a high percentile) hides it.
        slowdown = max(slowdown if slowdown == slowdown else 0.0, step[1])
    fp = subject_fingerprint(AlertKind.STRAGGLER, w.slot_node[slot], w.slot_index[slot], job)
    cost = _cost_gpu_hours(tick, gid, slowdown, waiting_peers)
    lost = state.add_cost(fp, tick.t, cost)
    causes = throttle_causes(tick, np.array([slot]))
    pattern = "host_idle" if idle else "gpu_clocks_cut" if clocks_cut else "gpu_slow"
    sm_known = _measured_by_sm(tick, gid, waiting_peers)
    evidence = _evidence(tick, slot, gid, ex, causes, pattern)
    evidence["estimated_job_slowdown_ratio"] = r3(slowdown)
    evidence["slowdown_measured_by"] = "sm_active" if sm_known else "power"
    evidence["gpu_hours_lost"] = round(lost, cfg.straggler_gpu_hours_digits)
    if waiting_peers and shared is not None:
        evidence["waiting_peers"] = waiting_peers
        evidence["peer_drop_vs_own_baseline"] = r3(shared.drop[slot])
        evidence["own_rise_vs_own_baseline"] = r3(shared.rise[slot])
    if tick.registry.kind(gid) != JOB:
        evidence["note"] = "no hpc_job attribution: compared with busy GPUs of the same model on this node"
    inferred_peers(tick.registry, gid, evidence)
    reasons = _reasons(tick, slot, gid, ex, causes, idle, waiting_peers)
    if step is not None:
        rise, fall, by_node = step
        evidence["step_rise_vs_peers"], evidence["step_job_fall"] = r3(rise), r3(fall)
        if by_node:
            evidence["step_peers"] = "node"  # its node's busy unattributed GPUs, not its group
        reasons.append(
            f"its {'SM activity' if sm_known else 'power'} against its peers' rose {percent(rise)} at once "
            f"while theirs fell {percent(fall)}"
        )
    retries = state.link_retry_counts(slot)
    if retries:
        evidence["link_retries"] = retries
        reasons.append(_link_reason(retries, cfg.window_seconds))
    summary = _summary(tick, slot, job, evidence, reasons + _shared_reason(slot, shared, waiting_peers, sm_known))
    # What it costs decides whether it is critical (engine/severity.py): nothing is lost or corrupted.
    sev = Severity.WARNING
    node, index, uuid = w.slot_node[slot], w.slot_index[slot], w.slot_uuid[slot]
    return Finding(AlertKind.STRAGGLER, node, index, uuid, job, sev, summary, evidence, cost_gpu_hours=cost)


def _waiting_peers(tick: Tick, slot: int, gid: int, shared: SharedNode | None) -> list[int]:
    """The GPU indexes of a shared-node culprit's peers that sank waiting for it ([]: not found so)."""
    if shared is None:
        return []
    sunk = np.flatnonzero(shared.sunk & (tick.groups.gid == gid))
    return [int(tick.windows.slot_index[s]) for s in sunk]


def _slowdown(
    tick: Tick,
    slot: int,
    gid: int,
    ex: np.ndarray,
    dev: np.ndarray,
    cross: bool,
    idle: bool,
    clocks_cut: bool,
    shared: SharedNode | None,
) -> float:
    """The job's slowdown put down to this GPU: its group's against the baseline, or what its peers'
    waiting, its idling or its cut clocks say where that is larger or unknown (NaN: unknown)."""
    slowdown = float(tick.slowdown[gid])
    if shared is not None:
        # Its waiting peers lost that share of their activity: the share of each step they spend waiting.
        slowdown = max(slowdown if slowdown == slowdown else 0.0, float(shared.drop[slot]))
    if not cross:
        return slowdown
    known = slowdown if slowdown == slowdown else 0.0
    if idle:
        # The peers spin for as long as it idles: its utilization gap is their share of each step.
        slowdown = max(known, float(-dev[UTIL]))
    else:
        # Peers' activity relative to the culprit's: how much of each step they spend waiting.
        rel = ex[SM] if not math.isnan(ex[SM]) else ex[PW]
        slowdown = max(known, 1.0 - 1.0 / (1.0 + max(rel, 0.0)))
    if clocks_cut:
        # A GPU at a fraction of its peers' clocks takes that much longer per step (compute-bound).
        slowdown = max(slowdown, float(-dev[CLK]))
    return slowdown


def _cost_gpu_hours(tick: Tick, gid: int, slowdown: float, waiting_peers: list[int]) -> float:
    """GPU-hours this tick lost to the culprit: its slowdown over the GPUs it slows (without attribution,
    itself and the GPUs that sank, not the node's whole group)."""
    slowed_gpus = len(waiting_peers) + 1 if waiting_peers else int(tick.groups.size[gid])
    return max(slowdown, 0.0) * slowed_gpus * tick.config.tick_seconds / SECONDS_PER_HOUR


def _measured_by_sm(tick: Tick, gid: int, waiting_peers: list[int]) -> bool:
    """Whether the slowdown was read from SM activity (else power); a shared-node culprit's is read from
    its waiting peers' own levels, not the group's baseline."""
    if waiting_peers:
        return not math.isnan(tick.groups.sm[gid])
    return bool(tick.slowdown_source[gid] == SlowdownSource.SM_ACTIVITY)


def _evidence(
    tick: Tick,
    slot: int,
    gid: int,
    ex: np.ndarray,
    causes: list[str],
    pattern: str,
) -> dict[str, Any]:
    """The GPU's readings against its peers' medians and its own baseline, and what set it apart."""
    m, grp = tick.med, tick.groups
    return {
        "peer_group": tick.registry.kind(gid),
        "peer_group_size": int(grp.size[gid]),
        "sm_active_ratio": r3(m["sm"][slot]),
        "peer_median_sm_active_ratio": r3(grp.sm[gid]),
        "sm_clock_ratio": r3(m["clock"][slot]),
        "peer_median_sm_clock_ratio": r3(grp.clock[gid]),
        "power_watts": r3(m["power"][slot]),
        "peer_median_power_watts": r3(grp.power[gid]),
        "utilization_ratio": r3(m["util"][slot]),
        "peer_median_utilization_ratio": r3(grp.util[gid]),
        "slow_throttle_bits_share": r3(m["slow"][slot]),
        "throttle_causes": causes,
        "excess_vs_own_baseline": {
            "sm_active": r3(ex[SM]),
            "power": r3(ex[PW]),
            "sm_clock": r3(ex[CLK]),
            "utilization": r3(ex[UTIL]),
        },
        "pattern": pattern,
    }


def _reasons(
    tick: Tick, slot: int, gid: int, ex: np.ndarray, causes: list[str], idle: bool, waiting_peers: list[int]
) -> list[str]:
    """What sets the GPU apart from its peers, in words: its peers' wait first, then its reading against
    theirs, then its clocks and throttling."""
    cfg, m, grp = tick.config, tick.med, tick.groups
    # Its peers' number first, the culprit's against it, and what the difference means: "0.70 vs 0.50" on
    # the culprit alone reads as if it were the better GPU.
    peers = len(waiting_peers) if waiting_peers else int(grp.size[gid]) - 1
    wait = f"its {peers} peer{'' if peers == 1 else 's'} wait for it"
    reasons = []
    if idle:
        reasons.append(
            f"it idles, waiting on its host, while {wait} "
            f"(utilization {m['util'][slot]:.2f} against {grp.util[gid]:.2f})"
        )
    elif ex[SM] >= cfg.straggler_sm_excess:
        reasons.append(
            f"it is still computing while {wait} (SM activity {m['sm'][slot]:.2f} against {grp.sm[gid]:.2f})"
        )
    elif math.isnan(grp.sm[gid]) and ex[PW] >= cfg.straggler_power_excess:
        reasons.append(
            f"it is still computing while {wait} (power {m['power'][slot]:.0f} W against {grp.power[gid]:.0f} W)"
        )
    else:
        reasons.append(wait)
    if -ex[CLK] >= cfg.straggler_clock_deficit:
        reasons.append(f"its SM clock runs at {percent(m['clock'][slot])} of max against {percent(grp.clock[gid])}")
    if m["slow"][slot] >= cfg.straggler_slow_bits_share:
        # Heat and the rest can each hold under half the samples while slowing bits hold most of them.
        reasons.append(
            "throttled: " + "; ".join(THROTTLE_CAUSES[c] for c in causes) if causes else "throttle/slowdown bits set"
        )
    return reasons


_LINK_WORDS = {
    "nvlink_replay": "NVLink replay",
    "nvlink_recovery": "NVLink recovery",
    "nvlink_crc_flit": "NVLink flit CRC error",
    "nvlink_crc_data": "NVLink data CRC error",
    "pcie_replay": "PCIe replay",
}


def _link_reason(retries: dict[str, int], window_seconds: float) -> str:
    """Its links' retries in the window, in words: each stalls a transfer its peers wait for."""
    counts = ", ".join(f"{n} {_LINK_WORDS.get(kind, kind)}{'' if n == 1 else 's'}" for kind, n in retries.items())
    return f"its links retry ({counts} in the last {window_seconds / SECONDS_PER_MINUTE:.0f} min)"


def _shared_reason(slot: int, shared: SharedNode | None, waiting_peers: list[int], sm_known: bool) -> list[str]:
    """A shared-node culprit's rise above its usual level against its sunk peers' fall, in words."""
    if not waiting_peers or shared is None:
        return []
    return [
        f"{'SM activity' if sm_known else 'power'} {percent(shared.rise[slot])} above its usual "
        f"level while GPUs {', '.join(map(str, waiting_peers))} of this node fell "
        f"{percent(shared.drop[slot])} below theirs"
    ]


def _summary(tick: Tick, slot: int, job: str | None, evidence: dict[str, Any], reasons: list[str]) -> str:
    """One line: which GPU is the slow one and why, then what its job loses to it as it fired."""
    w = tick.windows
    # The slowdown put down to this GPU as it fires, not the job's figure in /jobs (the job now against
    # its own baseline): the two may differ. Unknown (no baseline, no waiting peers measured): no figure.
    share = evidence["estimated_job_slowdown_ratio"]
    loses = (
        f". {'Job ' + job if job else 'Its peers'} lose{'s' if job else ''} ~{percent(share)} per step to it "
        "(estimated as it fired)"
        if isinstance(share, float)
        else ""
    )
    summary = f"GPU {w.slot_index[slot]} on {w.slot_node[slot]} is the slow one: " + "; ".join(reasons) + loses
    return summary + inferred_suffix(evidence)
