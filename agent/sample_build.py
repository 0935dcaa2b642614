"""GpuSamples built and copied without the dataclass `__init__`, for the sampling cycle.

A frozen dataclass's `__init__` stores each field through `object.__setattr__`, a global lookup and a call
per field: with some fifty fields that is most of what building a GpuSample costs, and every GPU builds
one per cycle (twice where attribution names a job). Storing through the slots' own descriptors gives an
equal object for half the CPU. Any field a later change adds is covered, since the plan is read from the
dataclass; should the model ever gain a `__post_init__`, these fall back to the real constructor.
"""

from __future__ import annotations

from dataclasses import MISSING, fields, replace
from typing import Any, Callable, Mapping

from gpufleet.agent.model import GpuSample

_FIELDS = fields(GpuSample)
_NAMES = tuple(f.name for f in _FIELDS)
_NAME_SET = frozenset(_NAMES)
_SETTERS: tuple[Callable[[Any, Any], None], ...] = tuple(GpuSample.__dict__[n].__set__ for n in _NAMES)
_GETTERS: tuple[Callable[..., Any], ...] = tuple(GpuSample.__dict__[n].__get__ for n in _NAMES)
_DEFAULTS = {f.name: f.default for f in _FIELDS if f.default is not MISSING}
_FACTORIES = tuple((f.name, f.default_factory) for f in _FIELDS if f.default_factory is not MISSING)
_REQUIRED = frozenset(n for n in _NAMES if n not in _DEFAULTS and n not in dict(_FACTORIES))
_DIRECT = "__post_init__" not in GpuSample.__dict__
_new = object.__new__


def build_sample(values: Mapping[str, Any]) -> GpuSample:
    """Equal to `GpuSample(**values)`, and raising what it raises for a missing or unknown field."""
    if not _DIRECT or not values.keys() <= _NAME_SET or not _REQUIRED <= values.keys():
        return GpuSample(**values)
    full = dict(_DEFAULTS)
    for name, factory in _FACTORIES:
        if name not in values:
            full[name] = factory()
    full.update(values)
    sample = _new(GpuSample)
    for store, name in zip(_SETTERS, _NAMES):
        store(sample, full[name])
    return sample


def replace_sample(sample: GpuSample, changes: Mapping[str, Any]) -> GpuSample:
    """Equal to `dataclasses.replace(sample, **changes)`."""
    if not _DIRECT or not changes.keys() <= _NAME_SET:
        return replace(sample, **changes)
    copy = _new(GpuSample)
    for store, load, name in zip(_SETTERS, _GETTERS, _NAMES):
        store(copy, changes[name] if name in changes else load(sample))
    return copy
