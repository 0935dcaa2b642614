"""The conditions a group must meet before anyone in it is judged a straggler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet

import numpy as np

from gpufleet.server.engine.detectors.straggler.state import StragglerState
from gpufleet.server.engine.tick import SlowdownSource, Tick


@dataclass(frozen=True, slots=True)
class GroupConditions:
    """Boolean arrays, per group (group_conditions) or per slot (at): what detect() asks of a group."""

    judgeable: np.ndarray  # old and big enough to judge, and active
    cross_steady: np.ndarray  # big, and steady long enough for the cross-section test
    slowed: np.ndarray  # peers slowed against the group's baseline by the minimum drop
    peers_spinning: np.ndarray  # median utilization at the waiting level
    active: np.ndarray  # median utilization at the active level
    one_job: np.ndarray  # a job group (attributed or inferred)
    slowdown_measured: np.ndarray  # the group's slowdown is known

    def at(self, group_of_slot: np.ndarray, in_group: np.ndarray) -> GroupConditions:
        """Per slot: its group's conditions (False outside groups), gathered in one go."""
        stacked = np.array(
            [
                self.judgeable,
                self.cross_steady,
                self.slowed,
                self.peers_spinning,
                self.active,
                self.one_job,
                self.slowdown_measured,
            ]
        )
        return GroupConditions(*(stacked[:, group_of_slot] & in_group))


def group_conditions(tick: Tick, state: StragglerState, cfg, halted: AbstractSet[int]) -> GroupConditions:
    """Per group: detect()'s conditions; a halted group is never big enough to judge."""
    grp = tick.groups
    n_groups = grp.n_groups
    big = grp.size >= cfg.straggler_min_group
    active = grp.util >= cfg.job_active_utilization
    aged = tick.t - tick.registry.first_seen[:n_groups] >= cfg.startup_grace_seconds
    steady = tick.t - state.steady_since(tick, cfg) >= cfg.startup_grace_seconds * cfg.straggler_cross_steady_ratio
    min_drop = np.where(
        tick.slowdown_source == SlowdownSource.POWER, cfg.straggler_min_power_drop, cfg.straggler_min_slowdown
    )
    if halted:
        big[list(halted)] = False
    return GroupConditions(
        judgeable=aged & big & active,
        cross_steady=steady & big,
        slowed=tick.slowdown >= min_drop,
        peers_spinning=grp.util >= cfg.straggler_waiting_utilization,
        active=active,
        one_job=tick.registry.one_job[:n_groups],
        slowdown_measured=~np.isnan(tick.slowdown),
    )
