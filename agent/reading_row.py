"""What a reading row says: where a raw value comes from, how it becomes the model's, how it is exported.

A reading's row sits on its `GpuSample` field (agent.model), as the field's metadata that `reading()`
puts there; agent.readings gathers the rows into the table everything else reads. This module is the
vocabulary of a row and imports nothing of the agent, so the model can use it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Literal

ALL_LINKS = 0xFFFFFFFF  # scope id that asks NVLink fields for the sum over all links

# --- the unit conversion and sanity check ---------------------------------------------------------


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


RATIO = Rule(div=100, high=1.0)  # percent 0-100 -> 0-1
TEMPERATURE = Rule(low=-40.0, high=150.0)
POWER = Rule(div=1000, high=5000.0)  # mW -> W, at most 5 kW
CLOCK = Rule(mul=1_000_000, high=5e9)  # MHz -> Hz, at most 5 GHz
# GDDR cards report the memory data rate as their memory clock (an L40S says 9001 MHz, GDDR7 ~15 GHz).
MEMORY_CLOCK = Rule(mul=1_000_000, high=40e9)
COUNT = Rule(integer=True)
COUNTER = Rule(integer=True, counter=True)
KIB_COUNTER = Rule(mul=1024, integer=True, counter=True)  # KiB -> bytes
FLAG = Rule(flag=True)
MIB_RATE = Rule(mul=1024 * 1024, high=1e13)  # MiB/s -> bytes/s, at most 10 TB/s


# --- where the raw value comes from -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FieldValue:
    """An entry of the per-poll nvmlDeviceGetFieldValues batch: a field id (pynvml's constant) and scope."""

    field_id: str
    scope: int = 0


@dataclass(frozen=True, slots=True)
class PerLinkField:
    """A field asked once per NVLink link (the scope is the link), with --nvlink.per-link; a tuple field."""

    field_id: str


@dataclass(frozen=True, slots=True)
class NvmlCall:
    """A device call `function(handle, *args, **kwargs)`, args and kwargs named by pynvml constant.

    Rows naming the same call are filled by one call per read; `part` picks a row's value from the answer
    (an attribute name, or an index into a tuple); None: the answer is the value. `at_open`: a limit
    that does not change while the driver runs, read when NVML opens (and retried while unread).
    """

    function: str
    args: tuple[str, ...] = ()
    part: str | int | None = None
    kwargs: tuple[tuple[str, str], ...] = ()
    at_open: bool = False

    @property
    def call(self) -> tuple[str, tuple[str, ...], tuple[tuple[str, str], ...], bool]:
        """What tells one call from another: rows equal here share one call."""
        return self.function, self.args, self.kwargs, self.at_open


@dataclass(frozen=True, slots=True)
class GpmMetric:
    """A GPM metric (pynvml's NVML_GPM_METRIC_* constant), averaged between two polls (agent.gpm).

    `apart`: asked in a second nvmlGpmMetricsGet on the same two samples, a read unit of its own that
    agent.tiers can slow, for a metric that costs far more than the rest of the call.
    """

    metric_id: str
    apart: bool = False


class Own(Enum):
    """Readings whose source has a module of its own."""

    THROTTLE_FIELDS = "throttle"  # one field per clocks-event reason (agent.nvml_fields), a mapping by reason
    XID_EVENTS = "xid"  # counted from NVML's event set on the XID thread (agent.xid)


Source = FieldValue | PerLinkField | NvmlCall | GpmMetric | Own


# --- how it is exported --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Family:
    """A per-GPU metric family; `label` tells apart the readings it carries (their rows' `label_value`).

    Counter names leave out _total, as prometheus_client's families do; the writer appends it.
    """

    name: str
    kind: Literal["gauge", "counter"]
    help: str
    label: str = ""


# --- the row ----------------------------------------------------------------------------------------------

ROW_KEY = "gpufleet.reading"  # the field metadata key that holds a GpuSample field's Row


@dataclass(frozen=True, slots=True)
class Row:
    """A reading's source, conversion, tier and series: what its GpuSample field's metadata holds."""

    source: Source
    rule: Rule
    # The family of its series (an agent.readings.FAMILIES name, or a Family of its own declared here)
    # and its label value; None: exported by a family agent.exposition writes itself.
    family: str | Family | None = None
    label_value: str = ""
    # A detector acts on it: read at least every tiers.FAST_MAX_AGE_S, whatever the CPU budget.
    fast: bool = False
    # Absent, not 0, on a GPU without NVLink (NVML answers these with zeros there).
    nvlink: bool = False


def reading(
    source: Source,
    rule: Rule,
    family: str | Family | None = None,
    label_value: str = "",
    *,
    fast: bool = False,
    nvlink: bool = False,
    default: Any = None,
    default_factory: Callable[[], Any] | None = None,
) -> Any:
    """A GpuSample field that is a reading: its default (None: unsupported) with its row as metadata."""
    metadata = {ROW_KEY: Row(source, rule, family, label_value, fast, nvlink)}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def row_of(field: dataclasses.Field[Any]) -> Row | None:
    """The reading row a dataclass field carries; None for a field that is no reading."""
    row = field.metadata.get(ROW_KEY)
    return row if isinstance(row, Row) else None
