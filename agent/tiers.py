"""Sampling tiers: how often each NVML read runs, fitted to a CPU budget from costs measured at open.

NVML calls differ by a thousand times in CPU: on an H100 with driver 580 the total energy counter costs
about 3 ms a read, the instant power 3 us. Which ones are slow depends on the driver and the GPU, so the
reader times every read while probing and this module spreads them over the cycles: each read unit gets
a period (every Nth cycle), the readings the detectors act on at most `fast_max_age_s` apart, the rest
at most `max_age_s`, doubled from 1, costliest first (the rest before the detectors' readings), until
the node's reads fit the budget. Where that is not enough, the costliest of the rest stretch to
`stretched_max_age_s`, one at a time, only as far as the budget needs: a cheap reading stays at
`max_age_s`, and the defaults fit their own budget on an 8-GPU H100 (the energy counter alone costs
a fifth of it once a minute). A
cumulative throttle-duration counter that does not fit every cycle is not read at all: its reason's bit
in the clocks-event mask, read every cycle, integrated over time gives the same duration for free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterable, Mapping

from gpufleet.agent.readings import READINGS

# A fraction of one core for the sampler's NVML reads. On top come the agent's own Python (about 0.16 % of a
# core on 8 GPUs, scrapes included), the attribution's process query (0.03 %) and the process's background
# (0.1 % on an H100: the XID thread's event waits, idle wakeups): all of it within half a percent of a
# core on an 8-GPU H100 node sampling at 1 Hz, even where the reads spend the whole budget.
DEFAULT_CPU_BUDGET = 0.002
FAST_MAX_AGE_S = 2.0
MAX_AGE_S = 60.0
# How far the costliest readings no detector uses may stretch (the energy counter, GPM's GRAPHICS_UTIL)
# where the budget is not met at MAX_AGE_S: a counter read every 2 minutes still counts every joule.
STRETCHED_MAX_AGE_S = 120.0
INTEGRATED = 0  # period of a throttle counter replaced by integrating its mask bit

# Readings the detectors use (the reading table's fast ones): never older than FAST_MAX_AGE_S.
FAST_READINGS = frozenset(r.name for r in READINGS if r.fast)
THROTTLE_PREFIX = "throttle_seconds_total."


@dataclass(frozen=True, slots=True)
class Unit:
    """One separately schedulable read (an NVML call, one field id, or GPM) and its cost on the node."""

    key: str
    readings: tuple[str, ...]
    # Thread CPU seconds per cycle it runs, summed over the node's GPUs.
    cost_s: float
    # A throttle-duration counter on GPUs whose reasons mask is read: the mask can stand in for it.
    integrable: bool = False

    @property
    def fast(self) -> bool:
        return any(r in FAST_READINGS for r in self.readings)


@dataclass(frozen=True, slots=True)
class Plan:
    """Unit key -> period in cycles (1: every cycle; INTEGRATED: from the mask), and what it costs."""

    periods: Mapping[str, int]
    cost_per_second: float
    budget: float
    fits: bool

    def period(self, key: str) -> int:
        """Units the plan has not seen (learned later) run every cycle."""
        return self.periods.get(key, 1)


EVERY_CYCLE = Plan(MappingProxyType({}), 0.0, math.inf, True)


def max_period(max_age_s: float, interval_s: float) -> int:
    """The longest period, in cycles, that keeps a reading at most max_age_s old (at least 1)."""
    return max(1, int(math.floor(max_age_s / interval_s + 1e-9)))


def fit(
    units: Iterable[Unit],
    *,
    budget: float,
    interval_s: float,
    fast_max_age_s: float = FAST_MAX_AGE_S,
    max_age_s: float = MAX_AGE_S,
    stretched_max_age_s: float = STRETCHED_MAX_AGE_S,
) -> Plan:
    """Periods that bring the node's NVML reads within `budget` (CPU seconds per second), costliest first:
    the rest to `max_age_s`, then the detectors' readings to `fast_max_age_s`, then the rest, costliest
    first, on to `stretched_max_age_s`.

    Where even the longest periods do not fit, every unit stays at its longest period (no reading ever
    gets older than its bound) and the plan says it does not fit.
    """
    units = list(units)
    periods = {u.key: 1 for u in units}
    limits = {u.key: max_period(fast_max_age_s if u.fast else max_age_s, interval_s) for u in units}
    stretched = {u.key: max_period(max(stretched_max_age_s, max_age_s), interval_s) for u in units if not u.fast}

    def rate(u: Unit) -> float:
        p = periods[u.key]
        return 0.0 if p == INTEGRATED else u.cost_s / (p * interval_s)

    total = sum(rate(u) for u in units)
    while total > budget:
        movable = [
            u
            for u in units
            if periods[u.key] != INTEGRATED and (periods[u.key] < limits[u.key] or (u.integrable and not u.fast))
        ]
        if not movable:
            if all(limits[k] >= limit for k, limit in stretched.items()):
                break
            limits.update(stretched)
            continue
        # The detectors' readings slow down only once everything else is at its longest period.
        slow_first = [u for u in movable if not u.fast] or movable
        worst = max(slow_first, key=lambda u: (rate(u), u.key))
        total -= rate(worst)
        if worst.integrable:
            periods[worst.key] = INTEGRATED
        else:
            periods[worst.key] = min(2 * periods[worst.key], limits[worst.key])
        total += rate(worst)
    return Plan(MappingProxyType(periods), total, budget, total <= budget)


def due(period: int, cycle: int, offset: int) -> bool:
    """True when a unit with this period runs in this cycle; offsets spread GPUs over the period."""
    return period == 1 or (period > 1 and (cycle + offset) % period == 0)
