"""The per-poll nvmlDeviceGetFieldValues batch: which field ids, which scopes, and each entry's own result.

The field ids and scopes are the reading table's (agent.readings), with one entry per clocks-event
reason for the throttle durations. One call per GPU fetches power, energy, HBM temperature, PCIe and NVLink counters and the cumulative
throttle durations. Every entry carries its own nvmlReturn, so one unsupported field never hides the
others; entries found unsupported are dropped so later polls stop asking for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import pynvml

from gpufleet.agent.model import ThrottleReason
from gpufleet.agent.nvml_errors import SUCCESS
from gpufleet.agent.readings import ALL_LINKS, READINGS, FieldValue, PerLinkField

__all__ = ["ALL_LINKS", "FieldBatch", "FieldEntry", "FieldResult", "batch_entries", "fetch", "read_link_count"]

# (reading, pynvml field id name, scope) of each scalar entry, in the reading table's order.
_SCALARS = tuple((r.name, r.source.field_id, r.source.scope) for r in READINGS if isinstance(r.source, FieldValue))

_THROTTLE_FIELDS = (
    (ThrottleReason.SW_POWER_CAP, "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP"),
    (ThrottleReason.SW_THERMAL_SLOWDOWN, "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN"),
    (ThrottleReason.HW_THERMAL_SLOWDOWN, "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN"),
    (ThrottleReason.HW_POWER_BRAKE_SLOWDOWN, "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN"),
    (ThrottleReason.SYNC_BOOST, "NVML_FI_DEV_CLOCKS_EVENT_REASON_SYNC_BOOST"),
)

_PER_LINK = tuple((r.name, r.source.field_id) for r in READINGS if isinstance(r.source, PerLinkField))

# nvmlValueType_t -> the c_nvmlValue_t union member holding the number.
_VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
_FV = pynvml.c_nvmlFieldValue_t
_GET_RETURN = _FV.nvmlReturn.__get__
_GET_TYPE = _FV.valueType.__get__
_GET_VALUE = _FV.value.__get__
_VALUE_GETTERS = {k: getattr(pynvml.c_nvmlValue_t, m).__get__ for k, m in _VALUE_MEMBERS.items()}


@dataclass(frozen=True, slots=True)
class FieldEntry:
    """One (field id, scope) the batch asks for, and the reading it feeds."""

    reading: str
    field_id: int
    scope: int


class FieldResult(NamedTuple):
    """One entry's outcome: its own return code (None: NVML left it out) and the raw number on success.

    A named tuple rather than a frozen dataclass: every entry of every poll makes one, and a tuple is
    made in a fifth of the time."""

    entry: FieldEntry
    code: int | None
    raw: int | float | None


def throttle_reading(reason: ThrottleReason) -> str:
    """Reading name of one reason's cumulative throttle duration."""
    return f"throttle_seconds_total.{reason.label}"


# Reading of each reason's cumulative duration -> the reason's bit in the clocks-event mask.
THROTTLE_READINGS: Mapping[str, ThrottleReason] = MappingProxyType(
    {throttle_reading(reason): reason for reason, _ in _THROTTLE_FIELDS}
)


def link_reading(base: str, link: int) -> str:
    """Reading name of one NVLink link's counter, e.g. 'nvlink_link_tx_bytes_total.3'."""
    return f"{base}.{link}"


def batch_entries(nvml: Any, *, link_count: int, per_link: bool) -> tuple[FieldEntry, ...]:
    """Every entry worth asking this GPU for; field ids this pynvml does not define are skipped."""
    wanted: list[tuple[str, str, int]] = list(_SCALARS)
    wanted += [(throttle_reading(reason), name, 0) for reason, name in _THROTTLE_FIELDS]
    if per_link:
        wanted += [(link_reading(base, i), name, i) for i in range(link_count) for base, name in _PER_LINK]
    return tuple(
        FieldEntry(reading, getattr(nvml, name), scope)
        for reading, name, scope in wanted
        if isinstance(getattr(nvml, name, None), int)
    )


def decode(value: Any) -> int | float | None:
    """The number in a c_nvmlFieldValue_t, per its valueType; None for a type we cannot read."""
    member = _VALUE_MEMBERS.get(int(value.valueType))
    return None if member is None else getattr(value.value, member)


def fetch(nvml: Any, handle: Any, entries: Sequence[FieldEntry], request: list | None = None) -> list[FieldResult]:
    """One nvmlDeviceGetFieldValues call; raises only when the call as a whole fails."""
    if not entries:
        return []
    if request is None:
        request = [(e.field_id, e.scope) for e in entries]
    values = nvml.nvmlDeviceGetFieldValues(handle, request)
    results = [_result(entry, value) for entry, value in zip(entries, values)]
    # An entry NVML did not answer at all is a failure of that entry, not of the batch.
    results += [FieldResult(entry, None, None) for entry in entries[len(results) :]]
    return results


def read_link_count(nvml: Any, handle: Any) -> int | None:
    """The GPU's NVLink link count, or None when the field is unsupported or unreadable."""
    field_id = getattr(nvml, "NVML_FI_DEV_NVLINK_LINK_COUNT", None)
    if not isinstance(field_id, int):
        return None
    (result,) = fetch(nvml, handle, [FieldEntry("nvlink_link_count", field_id, 0)])
    raw = result.raw
    return int(raw) if isinstance(raw, (int, float)) and 0 <= raw <= 64 else None


def _result(entry: FieldEntry, value: Any) -> FieldResult:
    """Pair an entry with its returned struct, checking the entry's own return code."""
    if type(value) is _FV:
        # Straight to the ctypes descriptors: pynvml's printable-structure __getattribute__ on each
        # member cost more than the rest of the batch's handling.
        code = _GET_RETURN(value)
        if code != SUCCESS:
            return FieldResult(entry, code, None)
        getter = _VALUE_GETTERS.get(_GET_TYPE(value))
        return FieldResult(entry, code, None if getter is None else getter(_GET_VALUE(value)))
    code = int(value.nvmlReturn)
    return FieldResult(entry, code, decode(value) if code == SUCCESS else None)


class FieldBatch:
    """The entries still worth polling on one GPU, with the request list built once, not per poll."""

    def __init__(self, entries: Iterable[FieldEntry]) -> None:
        self._entries: tuple[FieldEntry, ...] = ()
        self._request: list[tuple[int, int]] = []
        self._set(entries)

    def _set(self, entries: Iterable[FieldEntry]) -> None:
        self._entries = tuple(entries)
        self._request = [(e.field_id, e.scope) for e in self._entries]

    @property
    def entries(self) -> tuple[FieldEntry, ...]:
        """The entries polled now."""
        return self._entries

    def drop(self, readings: Iterable[str]) -> None:
        """Stop asking for these readings (found unsupported)."""
        gone = set(readings)
        if any(e.reading in gone for e in self._entries):
            self._set(e for e in self._entries if e.reading not in gone)

    def fetch(self, nvml: Any, handle: Any) -> list[FieldResult]:
        """Poll every remaining entry in one call."""
        return fetch(nvml, handle, self._entries, self._request)
