"""The detectors the engine runs, in the order it runs them, and what follows from their declarations:
lifecycle durations, advice, costing kinds, rules, and what a source without some reading cannot do.

Order matters: each detector reads what the ones before it concluded (detectors/spec.py). Health runs
before the straggler detector (a job hung by a lost GPU has no straggler), and the straggler detector
before the workload detector (a job's drop that a straggler, heat or a lost GPU explains is not the
workload's). An Engine takes any such tuple (Engine(config, detectors=...)); this one is the default.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Iterable, Mapping, Sequence

from gpufleet.server.alerts import AlertKind
from gpufleet.server.engine.config import EngineConfig
from gpufleet.server.engine.detectors import health, thermal, workload
from gpufleet.server.engine.detectors.spec import Detector, KindSpec
from gpufleet.server.engine.detectors.straggler import detector as straggler
from gpufleet.server.engine.rules import Rule, names

Detectors = Sequence[Detector[Any]]

STANDARD: tuple[Detector[Any], ...] = (thermal.DETECTOR, health.DETECTOR, straggler.DETECTOR, workload.DETECTOR)


def kind_specs(detectors: Detectors) -> tuple[KindSpec, ...]:
    """Every declared kind, in the detectors' order."""
    return tuple(spec for detector in detectors for spec in detector.kinds)


def declared_rules(detectors: Detectors = STANDARD) -> dict[str, tuple[Rule, ...]]:
    """Detector name -> its rules, in declaration order."""
    return {detector.name: detector.rules for detector in detectors}


def check(detectors: Detectors, config: EngineConfig) -> None:
    """ValueError unless the detectors' names, kinds and rules are unique, each kind's duration settings
    exist, and every rule the config disables is declared."""
    seen_names = [detector.name for detector in detectors]
    if len(set(seen_names)) != len(seen_names):
        raise ValueError(f"detector names repeat: {', '.join(seen_names)}")
    kinds = [spec.kind.value for spec in kind_specs(detectors)]
    if len(set(kinds)) != len(kinds):
        raise ValueError(
            f"alert kinds declared twice: {', '.join(sorted(k for k in set(kinds) if kinds.count(k) > 1))}"
        )
    for spec in kind_specs(detectors):
        for setting in (spec.for_setting, spec.clear_setting):
            if setting is not None and not isinstance(getattr(config, setting, None), (int, float)):
                raise ValueError(f"{spec.kind.value}: no numeric EngineConfig setting {setting!r}")
    unknown = config.disabled_rules - names(*declared_rules(detectors).values())
    if unknown:
        raise ValueError(f"disabled_rules names no declared rule: {', '.join(sorted(unknown))}")


def durations(detectors: Detectors, config: EngineConfig) -> dict[AlertKind, tuple[float, float]]:
    """Kind -> (for, clear) seconds, in the detectors' order (the order the lifecycle steps them in)."""
    return {spec.kind: spec.durations(config) for spec in kind_specs(detectors)}


def onset_leads(detectors: Detectors, config: EngineConfig) -> dict[AlertKind, float]:
    """Kind -> how long before its finding's first tick a newest-bin run may have begun (Lifecycle._held)."""
    return {spec.kind: onset_lead(spec, config) for spec in kind_specs(detectors)}


def onset_lead(spec: KindSpec, config: EngineConfig) -> float:
    """How long before its finding's first tick a kind's newest-bin run may have begun and still count: a
    rolling median crosses a threshold once half its window holds a change (a bin more for an even count
    of bins, where the kind asks for it: KindSpec.onset_after_median)."""
    return config.smooth_seconds / 2 + (config.tick_seconds if spec.onset_after_median else 0.0)


def early_runs(detectors: Detectors, config: EngineConfig) -> dict[AlertKind, float]:
    """Kind -> how much earlier still a newest-bin run may have begun and count from its onset lead
    (Lifecycle._held): half the smoothing window where the kind asks for it (KindSpec.early_run_counts)."""
    return {spec.kind: config.smooth_seconds / 2 if spec.early_run_counts else 0.0 for spec in kind_specs(detectors)}


def advice(detectors: Detectors) -> dict[AlertKind, str]:
    """Kind -> what to look at."""
    return {spec.kind: spec.advice for spec in kind_specs(detectors)}


def costing(detectors: Detectors) -> tuple[AlertKind, ...]:
    """The kinds whose findings estimate their cost, in the order a tick's loss is put down to them when
    several fire for one job at once."""
    return tuple(spec.kind for spec in kind_specs(detectors) if spec.costs)


def missing_effects(detectors: Iterable[Detector[Any]] = STANDARD) -> Mapping[str, tuple[tuple[str, str], ...]]:
    """Reading -> ((kind, what it cannot do without the reading), ...), for a source where no GPU has it."""
    out: dict[str, tuple[tuple[str, str], ...]] = {}
    for spec in kind_specs(tuple(detectors)):
        for reading, effect in spec.without:
            out[reading] = out.get(reading, ()) + ((spec.kind.value, effect),)
    return MappingProxyType(out)
