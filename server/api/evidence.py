"""Evidence as a person reads it: a label and a unit for each key, times in the reader's zone.

REST and the store keep the machine values (`sm_active_ratio 0.7`, `last_event_time 1795808310.88`);
the pages show `SM activity 0.70`, `last event 2026-11-27 03:12:40 CET`. A key without a label here is
shown by its name with its unit read from its ending, so a detector's new evidence is never hidden.
"""

from __future__ import annotations

from datetime import datetime, tzinfo
from typing import Any, Callable, Iterator

Format = Callable[[Any, "tzinfo | None"], str]


def _number(digits: int, unit: str = "") -> Format:
    def fmt(value: Any, _: tzinfo | None) -> str:
        return f"{value:.{digits}f}{unit}"

    return fmt


def _percent(value: Any, _: tzinfo | None) -> str:
    return f"{round(value * 100)} %"


def local_time(t: float, zone: tzinfo | None = None) -> str:
    """Unix seconds as a date and time in `zone` (None: the server's own zone), with the zone's name."""
    return datetime.fromtimestamp(t).astimezone(zone).strftime("%Y-%m-%d %H:%M:%S %Z").rstrip()


def _time(value: Any, zone: tzinfo | None) -> str:
    return local_time(float(value), zone)


_RATIO = _number(2)
_SECONDS = _number(0, " s")
_CELSIUS = _number(0, " °C")
_WATTS = _number(0, " W")
_HOURS = _number(2, " GPU-hours")

# key -> (label, format); a number's format only (strings, flags and lists are shown as they are).
LABELS: dict[str, tuple[str, Format | None]] = {
    "sm_active_ratio": ("SM activity", _RATIO),
    "peer_median_sm_active_ratio": ("peers' SM activity (median)", _RATIO),
    "sm_clock_ratio": ("SM clock, share of max", _percent),
    "peer_median_sm_clock_ratio": ("peers' SM clock (median)", _percent),
    "power_watts": ("power", _WATTS),
    "peer_median_power_watts": ("peers' power (median)", _WATTS),
    "utilization_ratio": ("utilization", _RATIO),
    "peer_median_utilization_ratio": ("peers' utilization (median)", _RATIO),
    "baseline_utilization_ratio": ("usual utilization", _RATIO),
    "estimated_job_slowdown_ratio": ("job slowdown put down to it", _percent),
    "estimated_clock_loss_ratio": ("clock lost to heat", _percent),
    "drop_ratio": ("drop against its usual level", _percent),
    "slow_throttle_bits_share": ("time with slowdown bits set", _percent),
    "gpu_hours_lost": ("GPU-hours lost", _HOURS),
    "peer_group": ("compared with", None),
    "peer_group_size": ("GPUs compared", None),
    "throttle_causes": ("what cut its clocks", None),
    "throttle_reasons": ("throttle reasons", None),
    "pattern": ("pattern", None),
    "slowdown_measured_by": ("slowdown measured by", None),
    "waiting_peers": ("GPUs waiting for it", None),
    "temperature_celsius": ("temperature", _CELSIUS),
    "threshold_celsius": ("alerts from", _CELSIUS),
    "slowdown_temperature_celsius": ("its slowdown temperature", _CELSIUS),
    "memory_temperature_celsius": ("HBM temperature", _CELSIUS),
    "memory_max_operating_temperature_celsius": ("HBM max operating temperature", _CELSIUS),
    "peer_median_temperature_celsius": ("peers' temperature (median)", _CELSIUS),
    "memory_at_limit": ("HBM at its limit", None),
    "clocks_cut": ("clocks cut", None),
    "near_slowdown_limit": ("near its slowdown temperature", None),
    "last_sample_time": ("last sample", _time),
    "last_event_time": ("last event", _time),
    "last_error_time": ("last error", _time),
    "last_success": ("last answer", _time),
    "silent_seconds": ("silent for", _SECONDS),
    "usual_lag_seconds": ("usual lag", _SECONDS),
    "threshold_seconds": ("alerts after", _SECONDS),
    "uncorrected_errors_new": ("uncorrected ECC errors", None),
    "remapped_rows_pending": ("row remap pending", None),
    "remapped_rows_failure": ("row remap failed", None),
    "code": ("XID code", None),
    "meaning": ("meaning", None),
    "count": ("events", None),
    "gpus": ("GPUs", None),
    "node_gpus": ("GPUs on the node", None),
    "signal": ("measured by", None),
    "baseline": ("usual level", None),
    "current": ("level now", None),
    "up": ("reports up", None),
    "missing": ("missing from its node's readings", None),
    "consecutive_failures": ("failures in a row", None),
    "last_error": ("last error", None),
    "resolved_reason": ("resolved because", None),
}

# Unit by a key's ending, for keys without a label (first match wins).
_ENDINGS: tuple[tuple[str, Format], ...] = (
    ("_time", _time),
    ("_timestamp_seconds", _time),
    ("_seconds", _SECONDS),
    ("_celsius", _CELSIUS),
    ("_watts", _WATTS),
    ("_ratio", _RATIO),
)


def label(key: str) -> str:
    """What a person calls an evidence key."""
    known = LABELS.get(key)
    return known[0] if known else key.replace("_", " ")


def shown(key: str, value: Any, zone: tzinfo | None = None) -> str:
    """One evidence value with its unit ('0.70', '86 °C', '2026-11-27 03:12:40 CET'); '-' for unknown."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value) or "none"
    if isinstance(value, dict):
        return "; ".join(f"{label(k)} {shown(k, v, zone)}" for k, v in value.items())
    if isinstance(value, (int, float)):
        fmt = LABELS[key][1] if key in LABELS else next((f for end, f in _ENDINGS if key.endswith(end)), None)
        return fmt(value, zone) if fmt is not None else _plain(value)
    return str(value)


def _plain(value: int | float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.3g}"


def rows(evidence: dict[str, Any], zone: tzinfo | None = None) -> Iterator[tuple[str, str]]:
    """(label, value with unit) for every evidence key, in the evidence's order (unescaped text)."""
    for key, value in evidence.items():
        yield label(key), shown(key, value, zone)
