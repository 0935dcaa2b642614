"""GPU-level straggler detection: which GPUs stand out from their peers in the culprit direction, what
is learned from each, and the finding that names one."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import AbstractSet

import numpy as np

from gpufleet.server.alerts import AlertKind, Severity
from gpufleet.server.engine.detectors import Finding, r3, subject_fingerprint
from gpufleet.server.engine.config import SECONDS_PER_HOUR
from gpufleet.server.engine.detectors.straggler.common import (
    CLK,
    NOW_ROWS,
    PW,
    SM,
    UTIL,
    clock_cut,
    follow,
    learning_rate,
    newest,
    percent,
    scales,
)
from gpufleet.server.engine.detectors.straggler.policy import (
    ACTIVITY,
    GPU_CLOCK_CUT_VS_FREE,
    HARDWARE,
    SHARED_RISE,
    SHARED_SUNK,
    STANDING_NOW,
)
from gpufleet.server.engine.detectors.straggler.state import StragglerState
from gpufleet.server.engine.groups import JOB
from gpufleet.server.engine.inference import inferred_peers, inferred_suffix
from gpufleet.server.engine.reduce import nan_to_zero
from gpufleet.server.engine.rules import MAD_TO_SIGMA, any_of, evaluate
from gpufleet.server.engine.tick import THROTTLE_CAUSES, SlowdownSource, Tick, throttle_causes

# Sign of the culprit direction of the SM, power and clock offsets (a culprit's clock is lower).
_CULPRIT_SIGN = np.array([[1.0], [1.0], [-1.0]])


def standing_now(
    tick: Tick, cfg, state: StragglerState, gi: np.ndarray, gsm_unknown: np.ndarray, on: np.ndarray
) -> np.ndarray:
    """Per slot: whether a GPU found standing out over the smoothing window still does in its newest
    readings (its newest bin, or the one before where that is empty), at the weaker margins; True where
    it has neither (no evidence against).

    The smoothing window's median lags by up to half its length. A GPU that recovered reads its normal
    level at once, while its peers' medians still hold their wait: it stood on against them for another
    15-30 s. Brief jitters back to back, each shorter than the for duration, fired so: one GPU slow twice
    (10 s sampling, and 5 s with 12 s between), and three GPUs slow in turn (1 s, the middle one named).
    A two-bin median still lagged enough to carry the 5 s case over its gap.
    """
    if not on.any():
        return on
    now = newest(tick, NOW_ROWS)
    if now is None:
        return np.ones_like(on)
    members = tick.groups.members
    assert members is not None  # Engine.advance builds them with every tick's groups
    peers = members.layout.medians(now[: UTIL + 1])[:, gi]
    dev = deviation(now[: UTIL + 1], peers)
    ex = dev - nan_to_zero(state.offset[:, : len(on)])
    arrays = {
        "sm_excess": ex[SM],
        "power_excess": ex[PW],
        "clock_deficit": -ex[CLK],
        "idle_excess": -np.fmin(ex[UTIL], dev[UTIL]),
        "slow_share": now[UTIL + 1],
        "sm_unsupported": gsm_unknown,
    }
    standing = any_of(evaluate(STANDING_NOW, arrays, cfg, cfg.straggler_weak_margin_ratio), _names(STANDING_NOW))
    return standing | np.isnan(now[UTIL])


def _names(rules) -> list[str]:
    return [r.name for r in rules]


def deviation(levels: np.ndarray, peers: np.ndarray) -> np.ndarray:
    """Per slot, rows as groups.LEVELS: SM activity, power and clock as a ratio to the peers' less 1,
    utilization as the difference from the peers'."""
    dev = levels / peers - 1.0
    dev[UTIL] = levels[UTIL] - peers[UTIL]
    return dev


def group_conditions(tick: Tick, state: StragglerState, cfg, halted: AbstractSet[int]) -> np.ndarray:
    """Per-group conditions of detect(), stacked (7, n_groups) so one gather maps them to slots: old
    and big enough to judge; steady long enough for the cross-section test; peers slowed against the
    baseline; peers spinning; group active; a job group; slowdown measured."""
    grp = tick.groups
    G = grp.n_groups
    big = grp.size >= cfg.straggler_min_group
    active = grp.util >= cfg.job_active_utilization
    aged = tick.t - tick.registry.first_seen[:G] >= cfg.startup_grace_seconds
    steady = tick.t - state.steady_since(tick, cfg) >= cfg.startup_grace_seconds * cfg.straggler_cross_steady_ratio
    min_drop = np.where(
        tick.slowdown_source == SlowdownSource.POWER, cfg.straggler_min_power_drop, cfg.straggler_min_slowdown
    )
    if halted:
        big[list(halted)] = False
    return np.array(
        [
            aged & big & active,
            steady & big,
            tick.slowdown >= min_drop,
            grp.util >= cfg.straggler_waiting_utilization,
            active,
            tick.registry.one_job[:G],
            ~np.isnan(tick.slowdown),
        ]
    )


def mixed_fallback(tick: Tick, standing: np.ndarray, gi: np.ndarray) -> np.ndarray:
    """Per slot: its group is an unattributed one (busy GPUs of one model on a node) where more than a
    share of the GPUs (straggler_mixed_standout_share) stand out at once.

    A straggler is one GPU, or a few, against many waiting peers. Without attribution a node's busy
    GPUs may be two jobs: when one of them slows, the other job's GPUs all "stand out" against the
    mixed median, each looking like a culprit. So many at once says the group is not one job, and
    nobody in it is named. A job group is exempt: there a brake on half a node is a real finding.
    """
    grp = tick.groups
    fallback = ~tick.registry.one_job[: grp.n_groups]
    if not fallback.any() or not standing.any():
        return np.zeros(len(gi), dtype=bool)
    counts = np.bincount(gi[standing], minlength=grp.n_groups)
    mixed = fallback & (counts > np.maximum(1, np.floor(grp.size * tick.config.straggler_mixed_standout_share)))
    return mixed[gi] & (grp.gid >= 0)


@dataclass(frozen=True)
class SharedNode:
    """A straggler found inside an unattributed node group that holds two jobs (see shared_node)."""

    on: np.ndarray  # (2, n) at scales(): the one GPU busier than usual while others sank
    waiting: np.ndarray  # per slot: its group shows the pattern
    drop: np.ndarray  # per slot: its group's sunk GPUs' mean share of activity lost
    rise: np.ndarray  # per slot: its reading against its own usual level, less 1
    sunk: np.ndarray  # per slot: sank below its usual level (a waiting peer)


def shared_node(
    tick: Tick, cfg, state: StragglerState, gi: np.ndarray, judged: np.ndarray, gsm_unknown: np.ndarray
) -> SharedNode:
    """Per slot: the one GPU of an unattributed node group that got busier than its own usual level while
    two or more of the group sank below theirs, at full utilization.

    Without attribution a node's busy GPUs may be two jobs. When a GPU of one slows silently (no clock
    cut, no bits), its own job's GPUs there wait: SM activity, or power, falls 12-30 % below their usual
    level. The other job's GPUs run on as before, so the node's median hardly moves and nobody stands out
    against it. The culprit computes through the time it used to wait: SM activity rose 15 % (0.59 to
    0.68 on an H100), power 4-7 % (L40S, A100). It is the only GPU of the group above its usual level.
    Judged against each GPU's own usual level, learned while nothing stood out, so slot and silicon
    differences cancel. A job's phase change moves all its GPUs together (none alone rises); a cap or a
    communication slowdown sinks them all (nobody rises).
    """
    grp = tick.groups
    n = len(gi)
    fallback = judged & ~tick.registry.one_job[: grp.n_groups][gi]
    both = scales(cfg)
    if not fallback.any():
        none = np.zeros(n, dtype=bool)
        return SharedNode(np.zeros((len(both), n), dtype=bool), none, np.full(n, np.nan), np.full(n, np.nan), none)
    with np.errstate(invalid="ignore", divide="ignore"):
        own = tick.levels[: PW + 1] / state.level[:, :n] - 1.0
        rel = np.where(gsm_unknown, own[PW], own[SM])
    arrays = {"own_drop": -rel, "own_rise": rel, "fallback": fallback, "sm_supported": ~gsm_unknown}
    arrays["sm_unsupported"] = gsm_unknown
    sunk = arrays["sunk"] = any_of(evaluate(SHARED_SUNK, arrays, cfg), _names(SHARED_SUNK))
    rise = any_of(evaluate(SHARED_RISE, arrays, cfg, both), _names(SHARED_RISE))
    G = grp.n_groups
    n_sunk = np.bincount(gi[sunk], minlength=G)
    drop = np.bincount(gi[sunk], weights=-rel[sunk], minlength=G) / np.maximum(n_sunk, 1)
    pattern = ((n_sunk > 1) & (np.bincount(gi[rise[-1]], minlength=G) == 1))[gi] & fallback
    return SharedNode(rise & pattern, pattern, np.where(pattern, drop[gi], np.nan), rel, sunk)


def reset_moved(state: StragglerState, cfg, g: np.ndarray, carried: np.ndarray, in_job: np.ndarray) -> None:
    """A GPU that joined another group starts learning afresh, unless what it learned carries over (its
    previous group was a part of the inferred job it joined: GroupRegistry.carried). A carried offset is
    held to a job's cap, as if learned there."""
    moved = (g >= 0) & (g != state.learned_gid[: len(g)])
    if moved.any():
        keep = moved & carried[: len(g)]
        state.forget(np.flatnonzero(moved & ~keep))
        if keep.any():
            cap = cfg.structural_max_offset
            off = state.offset[:, : len(g)]
            culprit = _CULPRIT_SIGN * np.clip(_CULPRIT_SIGN * off[:UTIL], 0.0, cap)
            off[:UTIL] = np.where(keep & in_job, culprit, off[:UTIL])
            off[UTIL] = np.where(keep & in_job, np.minimum(off[UTIL], 0.0), off[UTIL])
        state.learned_gid[moved] = g[moved]


def cuts(
    tick: Tick, cfg, dev: np.ndarray, gslow: np.ndarray, gi: np.ndarray, in_group: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per slot: clocks cut (see clock_cut), and "victim": a GPU without slowdown bits in a group where
    some GPU's clocks are cut, whose activity excess is spinning at full clocks, not work.

    Where a quarter or more of a group has slowdown bits, its median clock is no reference: a GPU with
    bits whose clock is 8 % below the median of the GPUs *without* bits is cut too (a power brake on half
    a node). dev[CLK] of such a GPU is set against those GPUs, for its signals and its evidence.
    """
    slow = tick.med["slow"]
    cut = clock_cut(cfg, dev[CLK], slow, gslow)
    bits = slow >= cfg.straggler_slow_bits_share
    grp = tick.groups
    if (bits & (gslow >= cfg.straggler_peer_slow_bits_share)).any():
        assert grp.members is not None
        free_clock = grp.members.layout.medians(np.where(bits, np.nan, tick.levels[CLK])[None, :])[0]
        dev_free = tick.levels[CLK] / free_clock[gi] - 1.0
        # Where clocks are not reported, the bits alone, as long as the group has GPUs reporting none.
        free = np.bincount(gi[in_group & (slow < cfg.straggler_slow_bits_share)], minlength=grp.n_groups) > 0
        arrays = {
            "free_deficit": -dev_free,
            "slow_share": slow,
            "has_bits": bits,
            "in_group": in_group,
            "clock_unsupported": np.isnan(tick.levels[CLK]),
            "free_peers": free[gi],
        }
        more = any_of(evaluate(GPU_CLOCK_CUT_VS_FREE, arrays, cfg), _names(GPU_CLOCK_CUT_VS_FREE))
        dev[CLK] = np.where(more, np.fmin(dev[CLK], dev_free), dev[CLK])
        cut |= more
    if not cut.any():
        return cut, cut
    cut_groups = np.bincount(gi[cut & in_group], minlength=grp.n_groups) > 0
    return cut, in_group & cut_groups[gi] & ~cut & ~bits


def signals(
    cfg,
    ex: np.ndarray,
    own: np.ndarray,
    state: StragglerState,
    gsm_unknown: np.ndarray,
    slow: np.ndarray,
    gslow: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Culprit signals at each of scales() x the configured margins, shape (2, n) (NaN comparisons are False),
    and those of them that are not the activity excess alone (clocks, bits); own: each GPU's smoothed SM
    activity and power, shape (2, n), set against their usual levels.

    A culprit keeps working: its SM activity stays within 15 % of its own usual level while its peers'
    drops (straggler_sm_kept_ratio). Where activity is not reported, its power keeps at least half its usual
    level (straggler_power_kept_ratio). In a job hung
    in its collective (a node crashed) every GPU fell to idle power, a quarter of their usual, and one
    drawing 10 W more than the others stood out by 10 %. Power is the looser test because an operator's
    cap lowers it too: a culprit under a cap to 250 W drew 0.73 of what it had before.

    The SM, power and clock margins widen to straggler_noise_sigmas x the group's usual spread of that
    excess where that is larger (learned_noise): in a noisy group one GPU or another stands out by the
    fixed margin at random, and with the generator's noise quadrupled three such were named.
    """
    level = state.level[:, : own.shape[1]]
    noise = learned_noise(state, cfg, own.shape[1])
    peer_bits = gslow >= cfg.straggler_peer_slow_bits_share
    arrays = {
        "sm_excess": ex[SM],
        "power_excess": ex[PW],
        "clock_deficit": -ex[CLK],
        "sm_spread": noise[SM],
        "power_spread": noise[PW],
        "clock_spread": noise[CLK],
        "slow_share": slow,
        "sm_kept": ~(own[SM] < cfg.straggler_sm_kept_ratio * level[SM]),
        "power_kept": ~(own[PW] < cfg.straggler_power_kept_ratio * level[PW]),
        "sm_unsupported": gsm_unknown,
        # Slowdown bits on one GPU and not its peers, confirmed by part of a margin of a reading; where
        # the GPU reports no clocks (the reading that shows what the bits do), the bits stand alone.
        "own_bits": (slow >= cfg.straggler_slow_bits_share) & ~peer_bits,
        "peer_bits": peer_bits,
        "clock_unsupported": np.isnan(ex[CLK]),
    }
    held = evaluate(ACTIVITY + HARDWARE, arrays, cfg, scales(cfg))
    other = any_of(held, _names(HARDWARE))
    return any_of(held, _names(ACTIVITY)) | other, other


def excess_in_noise(
    state: StragglerState, cfg, grp, act: np.ndarray, gi: np.ndarray, in_group: np.ndarray
) -> np.ndarray:
    """Per slot: its activity excess (act: SM activity's, or power's where SM activity is unsupported)
    over its group's median, in robust standard deviations of the group's excesses (NaN: unknown).

    A margin fixed in percent means less where readings are noisier. With the generator's noise tripled,
    a power-only job's power excesses spread by 2-4 % (one robust standard deviation) while it waited in
    slow collectives (power noise is the same in watts, so larger against the lower level), and one GPU
    or another of its 16 stood out at the weaker 4.2 % margin on half the ticks: comm_bound was held
    back for minutes, or for good. A culprit stands out from the spread of peers that all wait alike;
    noise stands within it. At the generator's own noise the spread is about 1.2 %, three of which stay
    under the weaker margins, so there this test rarely decides anything. One tick's spread among 16
    GPUs came out anywhere from 1.6 % to 4.3 % in that job, so the larger of it and its average over
    the last minute or so is taken.

    It does not gate naming a GPU: where offsets were never learned (a straggler from the job's start)
    each GPU's structural offset stays in its excess, and the spread with it; such culprits were named
    15-70 s later.
    """
    center, sigma = group_spread(grp, act[None, :], gi)
    n = len(gi)
    state.spread[:n] = follow(state.spread[:n], sigma[0], in_group, spread_rate(cfg))
    return (act - center[0]) / np.fmax(sigma[0], state.spread[:n])


def group_spread(grp, x: np.ndarray, gi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per slot and row of x (rows, n): its group's median of that row, and the group's robust standard
    deviation of it (MAD_TO_SIGMA x the median absolute deviation: one culprit does not widen it)."""
    layout = grp.members.layout
    center = layout.medians(x)[:, gi]
    return center, MAD_TO_SIGMA * layout.medians(np.abs(x - center))[:, gi]


def learned_noise(state: StragglerState, cfg, n: int) -> np.ndarray:
    """Per row and slot: its group's usual spread of each excess (gpus.learn), NaN while the GPU is still
    warming up (the spread of a ramp-up is no noise level: the margins' floors decide meanwhile)."""
    warm = state.learned[:n] >= cfg.bins(cfg.startup_grace_seconds)
    return np.where(warm, state.noise[:, :n], np.nan)


def spread_rate(cfg) -> float:
    """Per-tick rate of the spreads' moving averages (straggler_spread_time_constant_seconds)."""
    return 1.0 - math.exp(-cfg.tick_seconds / cfg.straggler_spread_time_constant_seconds)


def learn(
    state: StragglerState,
    cfg,
    dev: np.ndarray,
    own: np.ndarray,
    steady: np.ndarray,
    waiting: np.ndarray,
    in_job: np.ndarray,
    spread: np.ndarray | None = None,
) -> None:
    """Track each GPU's structural offset from its peers while its group runs steadily and unslowed, and
    (spread: per slot, its group's robust spread of each excess this tick) the group's usual noise.

    The first startup_grace_seconds of steady running learn fast (forgetting the ramp-up); after that
    the offsets follow slowly (outside jobs, first as the running mean of what follows: see
    common.learning_rate), and freeze while the group is slowed so a culprit is never absorbed. The
    noise follows over about a minute, and freezes likewise: a straggler's waiting peers, or one node of
    two standing out, would otherwise widen the margins that name it.
    """
    n = len(steady)
    warm_ticks = cfg.bins(cfg.startup_grace_seconds)
    warming = state.learned[:n] < warm_ticks
    learn = steady & (warming | ~waiting)
    alpha = learning_rate(cfg, state.learned[:n], ~in_job)
    state.offset = follow(state.offset, dev, learn, alpha)
    # Peers in one job run the same steps: a GPU that looked like a culprit from the very start is not
    # "structural" (capped). An offset in the victim direction is not learned at all: it could only make
    # a GPU look more like a culprit, and it did once a node slow from the start recovered - the GPUs that
    # had waited for it then stood out. (Fallback groups may mix unrelated work: their offsets stay free.)
    cap = cfg.structural_max_offset
    culprit = state.offset[:UTIL]
    state.offset[:UTIL] = np.where(in_job, _CULPRIT_SIGN * np.clip(_CULPRIT_SIGN * culprit, 0.0, cap), culprit)
    # The same holds for utilization, whose victim direction is up: beside a node host-starved from the job's
    # start, the other node's GPUs sat 0.17 above the job's median and learned it. Once the starved node
    # recovered, they read as idling 0.17 below their usual, and the node was named host-bound at equal
    # utilization as soon as noise made the job look slowed (found with the generator's noise doubled).
    # The culprit direction needs no cap: a GPU idling a whole margin below its peers learns nothing.
    state.offset[UTIL] = np.where(in_job, np.minimum(state.offset[UTIL], 0.0), state.offset[UTIL])
    state.level = follow(state.level, own, learn, alpha)
    if spread is not None:
        # Fast while warming up, as the offsets, so the ramp-up's wide spread is forgotten by the time it counts.
        state.noise = follow(
            state.noise, spread, learn, np.where(warming, cfg.straggler_fast_learning_ratio, spread_rate(cfg))
        )
    state.learned[:n] += learn


def gpu_finding(
    tick: Tick,
    state: StragglerState,
    slot: int,
    ex: np.ndarray,
    dev: np.ndarray,
    cross: bool = False,
    idle: bool = False,
    shared: SharedNode | None = None,
) -> Finding:
    """Evidence, cost and wording for one culprit GPU (idle: it idles on its host while its peers wait;
    shared: found by shared_node, against the GPUs of its node that sank)."""
    cfg = tick.config
    w, grp, m = tick.windows, tick.groups, tick.med
    gid = int(grp.gid[slot])
    job = tick.registry.job(gid)
    slowdown = float(tick.slowdown[gid])
    waiting_peers: list[int] = []
    if shared is not None:
        # Its waiting peers lost that share of their activity: the share of each step they spend waiting.
        slowdown = max(slowdown if slowdown == slowdown else 0.0, float(shared.drop[slot]))
        waiting_peers = [int(w.slot_index[s]) for s in np.flatnonzero(shared.sunk & (grp.gid == gid))]
    cut = m["slow"][slot] >= cfg.straggler_slow_bits_share and -dev[CLK] > 0.0
    if cross:
        known = slowdown if slowdown == slowdown else 0.0
        if idle:
            # The peers spin for as long as it idles: its utilization gap is their share of each step.
            slowdown = max(known, float(-dev[UTIL]))
        else:
            # Peers' activity relative to the culprit's: how much of each step they spend waiting.
            rel = ex[SM] if not math.isnan(ex[SM]) else ex[PW]
            slowdown = max(known, 1.0 - 1.0 / (1.0 + max(rel, 0.0)))
        if cut:
            # A GPU at a fraction of its peers' clocks takes that much longer per step (compute-bound).
            slowdown = max(slowdown, float(-dev[CLK]))
    size = int(grp.size[gid])
    # Without attribution the job here is the culprit and the GPUs that sank, not the node's whole group.
    slowed_gpus = len(waiting_peers) + 1 if waiting_peers else size
    # Its peers' number first, the culprit's against it, and what the difference means: at 3 a.m. "0.70 vs
    # 0.50" on the culprit reads as if it were the better GPU.
    peers = len(waiting_peers) if waiting_peers else size - 1
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
    causes = throttle_causes(tick, np.array([slot]))
    if m["slow"][slot] >= cfg.straggler_slow_bits_share:
        # Heat and the rest can each hold under half the samples while slowing bits hold most of them.
        reasons.append(
            "throttled: " + "; ".join(THROTTLE_CAUSES[c] for c in causes) if causes else "throttle/slowdown bits set"
        )
    # A shared-node culprit's slowdown is read from its waiting peers' own levels, not the group's baseline.
    sm_known = not math.isnan(grp.sm[gid]) if waiting_peers else tick.slowdown_source[gid] == SlowdownSource.SM_ACTIVITY
    measured_by = "sm_active" if sm_known else "power"
    if waiting_peers and shared is not None:
        reasons.append(
            f"{'SM activity' if sm_known else 'power'} {percent(shared.rise[slot])} above its usual "
            f"level while GPUs {', '.join(map(str, waiting_peers))} of this node fell "
            f"{percent(shared.drop[slot])} below theirs"
        )
    fp = subject_fingerprint(AlertKind.STRAGGLER, w.slot_node[slot], w.slot_index[slot], job)
    cost = max(slowdown, 0.0) * slowed_gpus * cfg.tick_seconds / SECONDS_PER_HOUR
    lost = state.add_cost(fp, tick.t, cost)
    evidence = {
        "peer_group": tick.registry.kind(gid),
        "peer_group_size": size,
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
        "pattern": "host_idle" if idle else "gpu_clocks_cut" if cut else "gpu_slow",
        "estimated_job_slowdown_ratio": r3(slowdown),
        "slowdown_measured_by": measured_by,
        "gpu_hours_lost": round(lost, cfg.straggler_gpu_hours_digits),
    }
    if waiting_peers and shared is not None:
        evidence["waiting_peers"] = waiting_peers
        evidence["peer_drop_vs_own_baseline"] = r3(shared.drop[slot])
        evidence["own_rise_vs_own_baseline"] = r3(shared.rise[slot])
    if tick.registry.kind(gid) != JOB:
        evidence["note"] = "no hpc_job attribution: compared with busy GPUs of the same model on this node"
    inferred_peers(tick.registry, gid, evidence)
    # What it costs decides whether it is critical (engine/severity.py): nothing is lost or corrupted.
    sev = Severity.WARNING
    # "Loses ~N % per step": the slowdown put down to this GPU, as it fires (the summary stays as it fired).
    # Not the job's figure in /jobs, which is the job now against its own baseline: the two may differ.
    # Unknown (no baseline yet, no waiting peers measured): the summary says who and why, without a figure.
    share = evidence["estimated_job_slowdown_ratio"]
    loses = (
        f". {'Job ' + job if job else 'Its peers'} lose{'s' if job else ''} ~{percent(share)} per step to it "
        "(estimated as it fired)"
        if isinstance(share, float)
        else ""
    )
    summary = (
        f"GPU {w.slot_index[slot]} on {w.slot_node[slot]} is the slow one: " + "; ".join(reasons) + loses
    ) + inferred_suffix(evidence)
    return Finding(
        AlertKind.STRAGGLER,
        w.slot_node[slot],
        w.slot_index[slot],
        w.slot_uuid[slot],
        job,
        sev,
        summary,
        evidence,
        cost_gpu_hours=cost,
    )
