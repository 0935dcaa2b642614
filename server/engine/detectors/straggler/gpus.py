"""GPU-level straggler detection: which GPUs stand out from their peers in the culprit direction, and
what is learned from each (the finding that names one is gpu_finding's)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

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
from gpufleet.server.engine.groups import group_order
from gpufleet.server.engine.reduce import nan_to_zero
from gpufleet.server.engine.rules import MAD_TO_SIGMA, MEAN_ABS_TO_SIGMA, any_of, evaluate
from gpufleet.server.engine.tick import Tick

# Sign of the culprit direction of the SM, power and clock offsets (a culprit's clock is lower).
_CULPRIT_SIGN = np.array([[1.0], [1.0], [-1.0]])


def standing_now(
    tick: Tick,
    cfg,
    state: StragglerState,
    group_of: np.ndarray,
    sm_unknown: np.ndarray,
    on: np.ndarray,
    shared: np.ndarray,
) -> np.ndarray:
    """Per slot: whether a GPU found standing out over the smoothing window still does in its newest
    readings (its newest bin, or the one before where that is empty), at the weaker margins; True where
    it has neither (no evidence against); shared: per slot, the roles its excesses are taken beyond
    (shared_roles). Also notes in the state since when each GPU has stood out in
    its newest readings at the full margins (StragglerState.note_standing).

    The smoothing window's median lags by up to half its length: a GPU that recovered would stand on
    against its peers' lagging medians, and brief jitters back to back would add up to one alert.
    """
    now = newest(tick, NOW_ROWS)
    if now is None:
        return np.ones_like(on)
    members = tick.groups.members
    assert members is not None  # Engine.advance builds them with every tick's groups
    peers = members.layout.medians(now[: UTIL + 1])[:, group_of]
    dev = deviation(now[: UTIL + 1], peers)
    ex = beyond_role(state, dev, dev - nan_to_zero(state.offset[:, : len(on)]), shared)
    arrays = {
        "sm_excess": ex[SM],
        "power_excess": ex[PW],
        "clock_deficit": -ex[CLK],
        "idle_excess": -np.fmin(ex[UTIL], dev[UTIL]),
        "slow_share": now[UTIL + 1],
        "sm_unsupported": sm_unknown,
    }
    scales = np.array([[cfg.straggler_weak_margin_ratio], [1.0]])
    weak, full = any_of(evaluate(STANDING_NOW, arrays, cfg, scales), _names(STANDING_NOW))
    unknown = np.isnan(now[UTIL])
    state.note_standing(tick.t - cfg.tick_seconds, cfg.tick_seconds, full, tick.held[0, : len(on)])
    return weak | unknown


def _names(rules) -> list[str]:
    return [r.name for r in rules]


def deviation(levels: np.ndarray, peers: np.ndarray) -> np.ndarray:
    """Per slot, rows as groups.LEVELS: SM activity, power and clock as a ratio to the peers' less 1,
    utilization as the difference from the peers'."""
    dev = levels / peers - 1.0
    dev[UTIL] = levels[UTIL] - peers[UTIL]
    return dev


def mixed_fallback(tick: Tick, standing: np.ndarray, group_of: np.ndarray) -> np.ndarray:
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
        return np.zeros(len(group_of), dtype=bool)
    counts = np.bincount(group_of[standing], minlength=grp.n_groups)
    mixed = fallback & (counts > np.maximum(1, np.floor(grp.size * tick.config.straggler_mixed_standout_share)))
    return mixed[group_of] & (grp.gid >= 0)


@dataclass(frozen=True)
class SharedNode:
    """A straggler found inside an unattributed node group that holds two jobs (see shared_node)."""

    on: np.ndarray  # (2, n) at scales(): the one GPU busier than usual while others sank
    waiting: np.ndarray  # per slot: its group shows the pattern
    drop: np.ndarray  # per slot: its group's sunk GPUs' mean share of activity lost
    rise: np.ndarray  # per slot: its reading against its own usual level, less 1
    sunk: np.ndarray  # per slot: sank below its usual level (a waiting peer)


def shared_node(
    tick: Tick, cfg, state: StragglerState, group_of: np.ndarray, judged: np.ndarray, sm_unknown: np.ndarray
) -> SharedNode:
    """Per slot: the one GPU of an unattributed node group that got busier than its own usual level while
    two or more of the group sank below theirs, at full utilization.

    Without attribution a node's busy GPUs may be two jobs. When a GPU of one slows silently (no clock
    cut, no bits), its own job's GPUs there wait and sink below their usual level, while the other job's
    run on, so the node's median hardly moves. The culprit computes through the time it used to wait: it
    is the only GPU of the group above its usual level. Each GPU is judged against its own usual level,
    so slot and silicon differences cancel; a phase change or a cap moves a job's GPUs together.
    """
    grp = tick.groups
    n = len(group_of)
    fallback = judged & ~tick.registry.one_job[: grp.n_groups][group_of]
    both = scales(cfg)
    if not fallback.any():
        none = np.zeros(n, dtype=bool)
        return SharedNode(np.zeros((len(both), n), dtype=bool), none, np.full(n, np.nan), np.full(n, np.nan), none)
    with np.errstate(invalid="ignore", divide="ignore"):
        own = tick.levels[: PW + 1] / state.level[:, :n] - 1.0
        rel = np.where(sm_unknown, own[PW], own[SM])
    arrays = {"own_drop": -rel, "own_rise": rel, "fallback": fallback, "sm_supported": ~sm_unknown}
    arrays["own_spread"] = np.where(sm_unknown, state.wander[PW, :n], state.wander[SM, :n])
    arrays["sm_unsupported"] = sm_unknown
    sunk = arrays["sunk"] = any_of(evaluate(SHARED_SUNK, arrays, cfg), _names(SHARED_SUNK))
    rise = any_of(evaluate(SHARED_RISE, arrays, cfg, both), _names(SHARED_RISE))
    n_groups = grp.n_groups
    n_sunk = np.bincount(group_of[sunk], minlength=n_groups)
    drop = np.bincount(group_of[sunk], weights=-rel[sunk], minlength=n_groups) / np.maximum(n_sunk, 1)
    pattern = ((n_sunk > 1) & (np.bincount(group_of[rise[-1]], minlength=n_groups) == 1))[group_of] & fallback
    return SharedNode(rise & pattern, pattern, np.where(pattern, drop[group_of], np.nan), rel, sunk)


def reset_moved(state: StragglerState, cfg, gid: np.ndarray, carried: np.ndarray, in_job: np.ndarray) -> None:
    """A GPU that joined another group starts learning afresh, unless what it learned carries over (its
    previous group was a part of the inferred job it joined: GroupRegistry.carried). A carried offset is
    held to a job's cap, as if learned there."""
    moved = (gid >= 0) & (gid != state.learned_gid[: len(gid)])
    if moved.any():
        keep = moved & carried[: len(gid)]
        state.forget(np.flatnonzero(moved & ~keep))
        if keep.any():
            # A role is against its peers: the new group's are others (stages._rebase_roles).
            state.role[:, keep] = np.nan
            state.role_learned[keep] = 0
            state.path[:, keep] = np.nan
            cap = cfg.structural_max_offset
            offset = state.offset[:, : len(gid)]
            culprit = _CULPRIT_SIGN * np.clip(_CULPRIT_SIGN * offset[:UTIL], 0.0, cap)
            offset[:UTIL] = np.where(keep & in_job, culprit, offset[:UTIL])
            offset[UTIL] = np.where(keep & in_job, np.minimum(offset[UTIL], 0.0), offset[UTIL])
        state.learned_gid[moved] = gid[moved]


def cuts(
    tick: Tick, cfg, dev: np.ndarray, peer_slow: np.ndarray, group_of: np.ndarray, in_group: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per slot: clocks cut (see clock_cut), and "victim": a GPU without slowdown bits in a group where
    some GPU's clocks are cut, whose activity excess is spinning at full clocks, not work.

    Where a share of a group (straggler_peer_slow_bits_share) has slowdown bits, its median clock is no
    reference: a GPU with bits whose clock is cut against the median of the GPUs *without* bits is cut
    too (GPU_CLOCK_CUT_VS_FREE: a power brake on half a node). dev[CLK] of such a GPU is set against those GPUs, for its signals and its evidence.
    """
    slow = tick.med["slow"]
    cut = clock_cut(cfg, dev[CLK], slow, peer_slow)
    bits = slow >= cfg.straggler_slow_bits_share
    grp = tick.groups
    if (bits & (peer_slow >= cfg.straggler_peer_slow_bits_share)).any():
        assert grp.members is not None
        free_clock = grp.members.layout.medians(np.where(bits, np.nan, tick.levels[CLK])[None, :])[0]
        dev_free = tick.levels[CLK] / free_clock[group_of] - 1.0
        # Where clocks are not reported, the bits alone, as long as the group has GPUs reporting none.
        free = np.bincount(group_of[in_group & (slow < cfg.straggler_slow_bits_share)], minlength=grp.n_groups) > 0
        arrays = {
            "free_deficit": -dev_free,
            "slow_share": slow,
            "has_bits": bits,
            "in_group": in_group,
            "clock_unsupported": np.isnan(tick.levels[CLK]),
            "free_peers": free[group_of],
        }
        more = any_of(evaluate(GPU_CLOCK_CUT_VS_FREE, arrays, cfg), _names(GPU_CLOCK_CUT_VS_FREE))
        dev[CLK] = np.where(more, np.fmin(dev[CLK], dev_free), dev[CLK])
        cut |= more
    if not cut.any():
        return cut, cut
    cut_groups = np.bincount(group_of[cut & in_group], minlength=grp.n_groups) > 0
    return cut, in_group & cut_groups[group_of] & ~cut & ~bits


def signals(
    cfg,
    ex: np.ndarray,
    own: np.ndarray,
    state: StragglerState,
    sm_unknown: np.ndarray,
    slow: np.ndarray,
    peer_slow: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Culprit signals at each of scales() x the configured margins, shape (2, n) (NaN comparisons are False),
    and those of them that are not the activity excess alone (clocks, bits); own: each GPU's smoothed SM
    activity and power, shape (2, n), set against their usual levels.

    A culprit keeps working: its SM activity stays near its own usual level (straggler_sm_kept_ratio),
    or where activity is not reported its power does (straggler_power_kept_ratio, looser, since an
    operator's cap lowers power too). So a GPU idling with a hung job is no culprit, whatever it draws.

    The SM, power and clock margins widen to straggler_noise_sigmas x the group's usual spread of that
    excess where that is larger (learned_noise): in a noisy group some GPU stands out by a fixed margin.
    """
    level = state.level[:, : own.shape[1]]
    noise = learned_noise(state, cfg, own.shape[1])
    # Where power is the activity reading its margin widens with the group's recent spread too, where that
    # is wider than the spread learned unslowed: a power reading's noise is watts whatever the GPU draws,
    # so as waiting peers' power falls the same noise weighs more against it (SM activity's is a share
    # of the work, and does not).
    recent = np.where(np.isnan(noise[PW]), noise[PW], np.fmax(noise[PW], state.spread[: own.shape[1]]))
    noise[PW] = np.where(sm_unknown, recent, noise[PW])
    peer_bits = peer_slow >= cfg.straggler_peer_slow_bits_share
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
        "sm_unsupported": sm_unknown,
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
    state: StragglerState, cfg, grp, act: np.ndarray, group_of: np.ndarray, in_group: np.ndarray
) -> np.ndarray:
    """Per slot: its activity excess (act: SM activity's, or power's where SM activity is unsupported)
    over its group's median, in robust standard deviations of the group's excesses (NaN: unknown).

    A margin fixed in percent means less where readings are noisier: a culprit stands out from the
    spread of peers that all wait alike, noise stands within it. One tick's spread is itself noisy, so
    the larger of it and its recent average (straggler_spread_time_constant_seconds) is taken.

    It only holds back workload alerts, never gates naming a GPU: where offsets were never learned (a
    straggler from the job's start) the structural offsets stay in the excesses and widen the spread.
    """
    center, sigma = group_spread(grp, act[None, :], group_of)
    n = len(group_of)
    state.spread[:n] = follow(state.spread[:n], sigma[0], in_group, spread_rate(cfg))
    return (act - center[0]) / np.fmax(sigma[0], state.spread[:n])


def group_spread(grp, x: np.ndarray, group_of: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per slot and row of x (rows, n): its group's median of that row, and the group's robust standard
    deviation of it (MAD_TO_SIGMA x the median absolute deviation: one culprit does not widen it)."""
    layout = grp.members.layout
    center = layout.medians(x)[:, group_of]
    return center, MAD_TO_SIGMA * layout.medians(np.abs(x - center))[:, group_of]


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
    # Peers in one job run the same steps: an offset in the culprit direction is capped to the structural
    # range, and none is learned in the victim direction, where it could only make a GPU that waited look
    # like a culprit once its straggler recovered. (Fallback groups may mix work: their offsets stay free.)
    cap = cfg.structural_max_offset
    culprit = state.offset[:UTIL]
    state.offset[:UTIL] = np.where(in_job, _CULPRIT_SIGN * np.clip(_CULPRIT_SIGN * culprit, 0.0, cap), culprit)
    # Likewise for utilization, whose victim direction is up (spinning above a host-starved node); its
    # culprit direction needs no cap, since a GPU idling a whole margin below its peers learns nothing.
    state.offset[UTIL] = np.where(in_job, np.minimum(state.offset[UTIL], 0.0), state.offset[UTIL])
    _learn_wander(state, cfg, own, learn & ~warming)
    state.level = follow(state.level, own, learn, alpha)
    _learn_role(state, cfg, dev, learn & ~warming)
    if spread is not None:
        # Fast while warming up, as the offsets, so the ramp-up's wide spread is forgotten by the time it counts.
        state.noise = follow(
            state.noise, spread, learn, np.where(warming, cfg.straggler_fast_learning_ratio, spread_rate(cfg))
        )
    state.learned[:n] += learn


def _learn_role(state: StragglerState, cfg, dev: np.ndarray, settled: np.ndarray) -> None:
    """Each GPU's stable offset from its peers' SM activity and power, uncapped: the running mean of its
    deviations over its healthy running after the warm-up, then following as slowly as the offsets. Not
    from the warm-up: a ramp-up's spread is no role."""
    n = len(settled)
    slow = 1.0 - math.exp(-cfg.tick_seconds / cfg.offset_time_constant_seconds)
    rate = np.maximum(1.0 / (state.role_learned[:n] + 1.0), slow)
    state.role[:, :n] = follow(state.role[:, :n], dev[: PW + 1], settled, rate)
    state.role_learned[:n] += settled


def _learn_wander(state: StragglerState, cfg, own: np.ndarray, settled: np.ndarray) -> None:
    """How far each GPU's SM activity and power wander from its usual level while it runs unslowed
    after its warm-up (mean absolute deviation, as a standard deviation), following as slowly as the
    offsets: a drifting expert's wander is its drift, which moves it within minutes."""
    n = len(settled)
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.abs(own / state.level[:, :n] - 1.0) * MEAN_ABS_TO_SIGMA
    slow = 1.0 - math.exp(-cfg.tick_seconds / cfg.offset_time_constant_seconds)
    rate = np.maximum(1.0 / (state.role_learned[:n] + 1.0), slow)
    state.wander[:, :n] = follow(state.wander[:, :n], rel, settled, rate)


def beyond_role(state: StragglerState, dev: np.ndarray, ex: np.ndarray, shared: np.ndarray) -> np.ndarray:
    """The excesses (rows as groups.LEVELS) with SM activity's and power's taken beyond the GPU's role
    (its uncapped stable offset, _learn_role) where that role is shared (shared_roles) and stands further
    in the culprit direction than its capped offset.

    In a job an offset in the culprit direction is capped to the structural range, so a GPU slow from
    the job's start is not absorbed; but a pipeline's last stage or an expert-heavy rank is steadily
    10-20 % busier than its peers, and whenever the job waits (on a real straggler, or a noisy dip of
    its baseline) that role stood out as a culprit. A stable difference of role is no fault; a change
    from the GPU's own normal still is.
    """
    n = ex.shape[1]
    out = ex.copy()
    act = slice(SM, PW + 1)
    out[act] = np.where(shared, np.fmin(ex[act], dev[act] - state.role[:, :n]), ex[act])
    return out


def shared_roles(state: StragglerState, cfg, gid: np.ndarray) -> np.ndarray:
    """Per slot, rows SM activity and power: the GPU's role (_learn_role) was learned long enough and
    another GPU of its group (gid, -1: none) has one within the structural range of it (role_mates).

    A role is a kind of rank (a stage holds several), so a GPU alone in its difference from the job's
    start is still judged against the cap. The role learns only while its group runs unslowed, so a
    culprit is never absorbed while its peers wait. Read once per tick: beyond_role takes every
    excess of the tick beyond the same roles.
    """
    n = len(gid)
    ready = state.role_learned[:n] >= cfg.bins(cfg.role_offset_seconds)
    return ready & role_mates(np.where(ready, state.role[:, :n], np.nan), gid, cfg.structural_max_offset)


def role_mates(role: np.ndarray, gid: np.ndarray, within: float) -> np.ndarray:
    """Per row of role (rows, n) and slot: another GPU of its group (gid, -1: none) has a role (NaN: none)
    within `within` of its own in that row. Row r's group g is sorted as the id r x n_groups + g, so one
    sort serves every row (equal roles are mates in any order, so the order of ties does not matter)."""
    rows, n = role.shape
    n_groups = int(gid.max(initial=-1)) + 1
    ids = (gid + np.arange(rows)[:, None] * n_groups).ravel()
    flat = role.ravel()
    known = np.flatnonzero(~np.isnan(flat) & np.tile(gid >= 0, rows))
    order = known[group_order(flat[known], ids[known], rows * n_groups)]
    close = (ids[order][1:] == ids[order][:-1]) & (np.diff(flat[order]) <= within)
    mate = np.zeros(rows * n, dtype=bool)
    mate[order[1:]] |= close
    mate[order[:-1]] |= close
    return mate.reshape(rows, n)


def follow_path(state: StragglerState, cfg, dev: np.ndarray, normal: np.ndarray, follows: np.ndarray) -> None:
    """Each GPU's own path (straggler_path_time_constant_seconds): its SM activity's and power's deviation
    from its peers, followed where `follows` (busy in its group past its learning), also while its group
    waits: an expert whose load drifts waits and is waited for in turn. Frozen while named, or standing
    out before its peers wait (named the moment they do), so a fault stays a departure from the path it
    left. It starts at the GPU's normal (`normal`:
    the deviation its excess is measured from, its offset or role), not at its first reading: a GPU slow
    since before it was first judged has left its normal already."""
    n = len(follows)
    rate = 1.0 - math.exp(-cfg.tick_seconds / cfg.straggler_path_time_constant_seconds)
    path = state.path[:, :n]
    row = dev[: PW + 1]
    moved = np.where(np.isnan(path), normal[: PW + 1], path + rate * (row - path))
    state.path[:, :n] = np.where(follows & ~np.isnan(row), moved, path)
