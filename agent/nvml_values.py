"""Unit conversion, sanity limits and counter-reset detection for NVML readings, kept as data.

NVML speaks MHz, mW, mJ, percent, KiB and nanoseconds; the model speaks base units. Drivers also hand
back garbage now and then (0xFFFFFFFF-style temperatures, NaN doubles, percentages above 100): a value
outside physical limits is dropped and counted rather than exported, so one bad read never draws a spike.
Cumulative counters may legitimately go backwards (driver reload, wrap); those are kept but flagged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping


@dataclass(frozen=True, slots=True)
class Rule:
    """How to turn one raw NVML number into a model value: raw * mul / div, then bounds (integer: no div)."""

    mul: int = 1
    div: int = 1
    low: float = 0.0
    high: float = math.inf
    integer: bool = False
    counter: bool = False
    flag: bool = False


INVALID: Any = object()  # convert()'s answer for a value that must be dropped and counted

_RATIO = Rule(div=100, high=1.0)  # percent 0-100 -> 0-1
_TEMPERATURE = Rule(low=-40.0, high=150.0)
_POWER = Rule(div=1000, high=5000.0)  # mW -> W, at most 5 kW
_CLOCK = Rule(mul=1_000_000, high=5e9)  # MHz -> Hz, at most 5 GHz
# GDDR cards report the memory data rate as their memory clock (an L40S says 9001 MHz, GDDR7 ~15 GHz).
_MEMORY_CLOCK = Rule(mul=1_000_000, high=40e9)
_COUNT = Rule(integer=True)
_COUNTER = Rule(integer=True, counter=True)
_FLAG = Rule(flag=True)

RULES: Mapping[str, Rule] = {
    "utilization_ratio": _RATIO,
    "memory_utilization_ratio": _RATIO,
    "sm_active_ratio": _RATIO,
    "sm_occupancy_ratio": _RATIO,
    "memory_used_bytes": _COUNT,
    "memory_total_bytes": _COUNT,
    "memory_free_bytes": _COUNT,
    "temperature_celsius": _TEMPERATURE,
    "memory_temperature_celsius": _TEMPERATURE,
    "slowdown_temperature_celsius": _TEMPERATURE,
    "shutdown_temperature_celsius": _TEMPERATURE,
    "max_operating_temperature_celsius": _TEMPERATURE,
    "memory_max_operating_temperature_celsius": _TEMPERATURE,
    "power_watts": _POWER,
    "power_limit_watts": _POWER,
    "energy_joules_total": Rule(div=1000, counter=True),  # mJ -> J
    "sm_clock_hertz": _CLOCK,
    "sm_clock_max_hertz": _CLOCK,
    "memory_clock_hertz": _MEMORY_CLOCK,
    "memory_clock_max_hertz": _MEMORY_CLOCK,
    "throttle_reasons": _COUNT,
    "throttle_seconds_total": Rule(div=1_000_000_000, counter=True),  # ns -> s
    "nvlink_tx_bytes_total": Rule(mul=1024, integer=True, counter=True),  # KiB -> bytes
    "nvlink_rx_bytes_total": Rule(mul=1024, integer=True, counter=True),
    "nvlink_link_tx_bytes_total": Rule(mul=1024, integer=True, counter=True),
    "nvlink_link_rx_bytes_total": Rule(mul=1024, integer=True, counter=True),
    "pcie_tx_bytes_total": _COUNTER,
    "pcie_rx_bytes_total": _COUNTER,
    "ecc_corrected_errors_total": _COUNTER,
    "ecc_uncorrected_errors_total": _COUNTER,
    "remapped_rows_correctable": _COUNT,
    "remapped_rows_uncorrectable": _COUNT,
    "remapped_rows_pending": _FLAG,
    "remapped_rows_failure": _FLAG,
    "xid_errors_total": _COUNTER,
}


def base_name(reading: str) -> str:
    """'throttle_seconds_total.sw_power_cap' -> 'throttle_seconds_total'."""
    return reading.partition(".")[0]


def convert(reading: str, raw: Any) -> Any:
    """The model value for a raw NVML number, or INVALID when it is not a sane number."""
    rule = RULES[base_name(reading)]
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
        self._last: dict[tuple[str, str, Any], float] = {}

    def check(self, uuid: str, values: Mapping[str, Any]) -> tuple[str, ...]:
        """Names in `values` whose counters decreased since this GPU's previous check."""
        backwards: set[str] = set()
        for name, key, value in _flatten(values):
            slot = (uuid, name, key)
            previous = self._last.get(slot)
            if previous is not None and value < previous:
                backwards.add(name)
            self._last[slot] = value
        return tuple(sorted(backwards))


def _flatten(values: Mapping[str, Any]) -> Iterator[tuple[str, Any, float]]:
    """(name, key, value) for every present counter value, looking inside per-reason/per-link fields."""
    for name, value in values.items():
        rule = RULES.get(name)
        if rule is None or not rule.counter:
            continue
        if isinstance(value, Mapping):
            yield from ((name, key, v) for key, v in value.items() if v is not None)
        elif isinstance(value, tuple):
            yield from ((name, i, v) for i, v in enumerate(value) if v is not None)
        elif value is not None:
            yield name, None, value
