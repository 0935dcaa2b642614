"""Unit conversion, sanity limits and counter-reset detection for NVML readings, by each one's Rule.

NVML speaks MHz, mW, mJ, percent, KiB and nanoseconds; the model speaks base units. Drivers also hand
back garbage now and then (0xFFFFFFFF-style temperatures, NaN doubles, percentages above 100): a value
outside physical limits is dropped and counted rather than exported, so one bad read never draws a spike.
Cumulative counters may legitimately go backwards (driver reload, wrap); those are kept but flagged.
Each reading's rule is its row's in the reading table (agent.readings).
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Mapping

from gpufleet.agent.readings import READINGS, Rule

__all__ = ["INVALID", "RULES", "CounterTracker", "Rule", "base_name", "convert"]


INVALID: Any = object()  # convert()'s answer for a value that must be dropped and counted

# Reading -> its rule, from the reading table; a plain dict, looked up for every value read.
RULES: Mapping[str, Rule] = {r.name: r.rule for r in READINGS}


def base_name(reading: str) -> str:
    """'throttle_seconds_total.sw_power_cap' -> 'throttle_seconds_total'."""
    return reading.partition(".")[0]


def convert(reading: str, raw: Any) -> Any:
    """The model value for a raw NVML number, or INVALID when it is not a sane number."""
    rule = RULES.get(reading) or RULES[base_name(reading)]
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        return INVALID
    if rule.flag:
        return bool(raw)
    if isinstance(raw, float) and not math.isfinite(raw):
        return INVALID
    value = _scale(rule, raw)
    if not rule.low <= value <= rule.high:
        return INVALID
    return value


def _scale(rule: Rule, raw: int | float) -> int | float:
    """Apply the rule's unit factor, staying integral (exact) where the model field is an int."""
    if rule.integer:
        return int(raw) * rule.mul
    return float(raw * rule.mul) / rule.div


class CounterTracker:
    """Remembers each GPU's last counter values and names the counters that went backwards."""

    def __init__(self) -> None:
        # GPU -> counter (its name, or (name, key) inside a per-reason or per-link field) -> last value.
        self._last: dict[str, dict[Any, float]] = {}

    def check(self, uuid: str, values: Mapping[str, Any]) -> tuple[str, ...]:
        """Names in `values` whose counters decreased since this GPU's previous check."""
        backwards: set[str] = set()
        last = self._last.get(uuid)
        if last is None:
            last = self._last[uuid] = {}
        for name in _COUNTERS:
            value = values.get(name)
            if value is None:
                continue
            if type(value) is int or type(value) is float:  # most counters: no generator, no ABC check
                previous = last.get(name)
                if previous is not None and value < previous:
                    backwards.add(name)
                last[name] = value
                continue
            for _, key, item in _flatten({name: value}):
                previous = last.get((name, key))
                if previous is not None and item < previous:
                    backwards.add(name)
                last[(name, key)] = item
        return tuple(sorted(backwards)) if backwards else ()


# The counter readings, from the table once: a sample's other fields are never looked at.
_COUNTERS = tuple(name for name, rule in RULES.items() if rule.counter)


def _flatten(values: Mapping[str, Any]) -> Iterator[tuple[str, Any, float]]:
    """(name, key, value) for every present counter value, looking inside per-reason/per-link fields."""
    for name in _COUNTERS:
        value = values.get(name)
        if value is None:
            continue
        if type(value) is int or type(value) is float:  # most counters; skips the ABC check below
            yield name, None, value
        elif isinstance(value, Mapping):
            yield from ((name, key, v) for key, v in value.items() if v is not None)
        elif isinstance(value, tuple):
            yield from ((name, i, v) for i, v in enumerate(value) if v is not None)
        elif value is not None:
            yield name, None, value
