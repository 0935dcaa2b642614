"""What a detector declares to the engine, and what it says at each tick.

A detector is one `Detector` value, declared in its own module: its kinds (each with its lifecycle
durations, advice and the readings it cannot do without), its rules, how to make its state and how that
state forgets a node, a restarted group or a recycled group id, and its detect function. The engine runs
an ordered tuple of them (engine/registry.py) and knows no detector by name.

A detector tells the ones after it what it concluded through its Detection's sets (halted, explained,
standout, idling, singled_out): the engine joins them into the Context the next detector reads, so the
order of the tuple alone decides what each can see.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import AbstractSet, Any, Callable, Generic, Mapping, TypeVar

import numpy as np

from gpufleet.server.alerts import AlertKind
from gpufleet.server.engine.config import EngineConfig
from gpufleet.server.engine.detectors import Context, Outcome
from gpufleet.server.engine.groups import GroupRegistry
from gpufleet.server.engine.rules import Rule
from gpufleet.server.engine.tick import Tick
from gpufleet.server.engine.windows import Windows


@dataclass(frozen=True, slots=True, kw_only=True)
class KindSpec:
    """One kind of alert a detector raises, as the lifecycle, the outputs and the sources need it."""

    kind: AlertKind  # its name, and whether the job is part of its subject (AlertKind.job_keyed)
    advice: str  # what to look at: the second half of every such alert's description
    # EngineConfig settings: how long the condition holds before it fires, and how long its clear
    # condition holds before it resolves (None: at once).
    for_setting: str | None = None
    clear_setting: str | None = None
    costs: bool = False  # its findings estimate what they cost their job (Finding.cost_gpu_hours)
    # (reading, what the kind cannot do where no GPU reports it): readings by their contract names.
    without: tuple[tuple[str, str], ...] = ()
    # Whether its newest-bin run must wait out a rolling median of an even count of bins: that median
    # crosses a threshold one bin after half its window holds a step, and the run is dated from its
    # first bin's start, so a clean job-wide step is confirmed half a window and one bin after its run
    # began (20 s at 30 s smoothing over 5 s bins).
    onset_after_median: bool = False
    # Whether a newest-bin run that began up to half a smoothing window before its onset lead still
    # counts, from the lead: under noisy readings a subject often stands out in a bin or two before its
    # change. Not for kinds a later finding must be able to pre-empt (comm_bound waits for a straggler).
    early_run_counts: bool = False

    def durations(self, config: EngineConfig) -> tuple[float, float]:
        """(for, clear) seconds under a config."""
        return (
            0.0 if self.for_setting is None else float(getattr(config, self.for_setting)),
            0.0 if self.clear_setting is None else float(getattr(config, self.clear_setting)),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Detection:
    """What one detector says at one tick: an outcome per kind it declares, and what it concluded for the
    detectors after it (group ids; see Context for what each set means)."""

    outcomes: Mapping[AlertKind, Outcome]
    halted: AbstractSet[int] = frozenset()
    explained: AbstractSet[int] = frozenset()
    standout: AbstractSet[int] = frozenset()
    idling: AbstractSet[int] = frozenset()
    singled_out: AbstractSet[int] = frozenset()


_CONCLUSIONS = tuple(f.name for f in fields(Detection) if f.name != "outcomes")


def joined(context: Context, detection: Detection) -> Context:
    """The context the next detector reads: each set of the context with the detection's added."""
    added = {name: getattr(detection, name) for name in _CONCLUSIONS if getattr(detection, name)}
    if not added:
        return context
    return replace(context, **{name: getattr(context, name) | more for name, more in added.items()})


S = TypeVar("S")


def _nothing(*_: Any) -> None:
    """A state with nothing to drop."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Detector(Generic[S]):
    """One detector: what it raises and the functions the engine calls on it. `state` makes a fresh state
    per engine; the hooks keep it in step with the windows and the groups (the defaults drop nothing)."""

    name: str  # also the name of its rules' section in docs/detection.md and the evaluation
    kinds: tuple[KindSpec, ...]
    rules: tuple[Rule, ...]
    state: Callable[[], S]
    detect: Callable[[Tick, S, Context], Detection]
    # A node no longer watched: its GPUs' slots (reused if it returns) and its node id.
    forget_node: Callable[[S, np.ndarray, int | None], None] = _nothing
    # Groups whose work changed (GroupRegistry.restarted): their GPUs' slots, to be learned afresh.
    restart: Callable[[S, np.ndarray], None] = _nothing
    # A group id given to a new group: the id and the old group's key.
    recycle: Callable[[S, int, tuple, GroupRegistry, Windows], None] = _nothing
    # Every index_prune_ticks: the fingerprints of the open alerts, which must be kept.
    prune: Callable[[S, set[str], EngineConfig], None] = _nothing
