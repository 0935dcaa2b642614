"""Which NVML call feeds which reading: the identity strings here, the readings' calls from the reading table.

Each Call names the GpuSample fields it fills and fetches their raw NVML values in one go (one call can
feed several fields, e.g. utilization rates). The calls that give readings are the NvmlCall rows of
agent.readings; with the identity calls here they are the list to check against docs/nvml-calls.md.
Only current, non-deprecated functions appear.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter, itemgetter
from typing import Any, Callable

from gpufleet.agent.readings import READINGS, NvmlCall


@dataclass(frozen=True, slots=True)
class Call:
    """One NVML call and the readings it fills, in the order fetch() returns their raw values."""

    readings: tuple[str, ...]
    fetch: Callable[[Any, Any], tuple[Any, ...]]


def text(value: Any) -> str:
    """NVML strings arrive as str or bytes depending on the pynvml version; the model wants str."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace").strip("\x00")
    return str(value)


def _one(fetch: Callable[[Any, Any], Any]) -> Callable[[Any, Any], tuple[Any, ...]]:
    """Wrap a single-value fetch into the tuple form."""
    return lambda nvml, handle: (fetch(nvml, handle),)


# Strings that identify the GPU; read once at open.
IDENTITY = (
    Call(("uuid",), _one(lambda n, h: text(n.nvmlDeviceGetUUID(h)))),
    Call(("model",), _one(lambda n, h: text(n.nvmlDeviceGetName(h)))),
    Call(("pci_bus_id",), _one(lambda n, h: text(n.nvmlDeviceGetPciInfo_v3(h).busId))),
    Call(("serial",), _one(lambda n, h: text(n.nvmlDeviceGetSerial(h)))),
    Call(("vbios_version",), _one(lambda n, h: text(n.nvmlDeviceGetVbiosVersion(h)))),
)


def _invoke(spec: NvmlCall) -> Callable[[Any, Any], Any]:
    """The call a row describes, its constant arguments looked up on the nvml object at each call."""
    fn, args, kwargs = spec.function, spec.args, spec.kwargs
    if kwargs:
        return lambda n, h: getattr(n, fn)(h, *[getattr(n, a) for a in args], **{k: getattr(n, v) for k, v in kwargs})
    if not args:
        return lambda n, h: getattr(n, fn)(h)
    if len(args) == 1:
        (arg,) = args
        return lambda n, h: getattr(n, fn)(h, getattr(n, arg))
    return lambda n, h: getattr(n, fn)(h, *[getattr(n, a) for a in args])


def _fetch(spec: NvmlCall, parts: tuple[str | int | None, ...]) -> Callable[[Any, Any], tuple[Any, ...]]:
    """One call's answer split into its rows' values, in row order."""
    invoke = _invoke(spec)
    if parts == (None,):
        return lambda n, h: (invoke(n, h),)
    names = [p for p in parts if isinstance(p, str)]
    indices = [p for p in parts if isinstance(p, int)]
    pick: Callable[[Any], Any]
    if len(names) == len(parts):
        pick = attrgetter(*names)
    elif len(indices) == len(parts):
        pick = itemgetter(*indices)
    else:
        raise ValueError(f"{spec.function}: each row of a call several rows share names its part, of one kind: {parts}")
    if len(parts) == 1:
        return lambda n, h: (pick(invoke(n, h)),)
    return lambda n, h: pick(invoke(n, h))


def _calls(at_open: bool) -> tuple[Call, ...]:
    """The table's calls read at open (or on every poll), one per distinct call, in the order of its first row."""
    rows: dict[tuple[Any, ...], list[tuple[str, NvmlCall]]] = {}
    for reading in READINGS:
        spec = reading.source
        if isinstance(spec, NvmlCall) and spec.at_open == at_open:
            rows.setdefault(spec.call, []).append((reading.name, spec))
    return tuple(
        Call(tuple(name for name, _ in group), _fetch(group[0][1], tuple(spec.part for _, spec in group)))
        for group in rows.values()
    )


# Limits that do not change while the driver runs; read once at open.
STATIC = _calls(at_open=True)

# Read on every poll (besides the field-value batch and GPM).
POLLED = _calls(at_open=False)


def cuda_version_text(version: Any) -> str | None:
    """12040 -> '12.4', as nvidia-smi prints the CUDA driver version."""
    if isinstance(version, bool) or not isinstance(version, int) or version <= 0:
        return None
    return f"{version // 1000}.{version % 1000 // 10}"
