"""Rules as data: a detector's policy is a declared tuple of Rule, evaluated by `evaluate` over the arrays
its machinery computed (windows, peer groups, baselines, learned offsets).

A rule holds when its signal reaches its margin and all its gates hold (and none of its `unless` gates):

    signal >= max(scale x config[margin] [x config[factor]], config[sigmas] x spread)

A rule may also measure its margin from a per-subject `reference` (a GPU's own temperature limit), take
a `factor` share of it or settings `less` (a clear condition's hysteresis), pass it strictly (`op` ">")
or lie under it (`op` "<": the condition of being back, or a reading under a limit).

The margin is a named EngineConfig setting, the floor; where the rule names a spread (the subject's own
robust noise, e.g. 1.4826 x the MAD of its group's readings) the margin widens with it, so a noisy job
needs a larger difference than a quiet one under the same defaults. Signals are oriented so that larger
means "fires" (a clock deficit is the negated clock offset). A NaN signal or spread never fires and never
widens: an unsupported reading is absent, not 0.

Everything numeric lives in EngineConfig; the machinery supplies arrays by name. A rule named in
EngineConfig.disabled_rules never holds: that is how the evaluation's ablation table switches each one off.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

# 1.4826 x the median absolute deviation estimates the standard deviation of normal noise (1 / the 75th
# percentile of the standard normal distribution): a robust spread that one outlier does not widen.
MAD_TO_SIGMA = 1.4826
# sqrt(pi / 2) x the mean absolute deviation estimates the standard deviation of normal noise.
MEAN_ABS_TO_SIGMA = math.sqrt(math.pi / 2.0)
# The k-th of n sorted readings stands for the quantile (k + 0.5) / n (the midpoint plotting position), so
# that two samples of different sizes are compared rank for rank without favouring either end.
MIDPOINT_RANK = 0.5


@dataclass(frozen=True, slots=True, kw_only=True)
class Rule:
    """One named condition of a detector."""

    name: str  # stable identifier: EngineConfig.disabled_rules, the ablation table, the docs
    doc: str  # one line for the reference: what holding it means
    signal: str  # key of a per-subject array, oriented so that larger fires
    margin: str | None  # EngineConfig setting: the margin's floor (scaled by `evaluate`'s scales); None: zero
    spread: str | None = None  # key of a per-subject robust spread; None: the floor alone
    sigmas: str | None = None  # EngineConfig setting: how many spreads the margin widens to
    gates: tuple[str, ...] = ()  # keys of boolean arrays that must all hold
    unless: tuple[str, ...] = ()  # keys of boolean arrays none of which may hold
    # How the signal meets its threshold: ">=" reaches it, ">" must pass it, "<" lies under it (a clear
    # condition, or a reading below a limit). "<" takes no spread.
    op: str = ">="
    factor: str | None = None  # EngineConfig setting the margin is multiplied by (a share of another margin)
    less: tuple[str, ...] = ()  # EngineConfig settings taken off the margin (hysteresis, a margin under a limit)
    reference: str | None = None  # key of a per-subject level the margin is measured from (a GPU's own limit)
    # Key of the series the spread is compared with where it is not the signal: a drop measured from a
    # baseline whose noise is measured around the median. Then both must hold: the signal its floor, this
    # series `sigmas` spreads (a NaN here, or in the spread, leaves the floor alone).
    spread_signal: str | None = None
    scaled: bool = True  # False: the floor is the same at every scale of `evaluate` (a plain cut-off)
    scale_spread: bool = False  # True: the widened margin scales too (weaker margins stay a share of it)

    def __post_init__(self) -> None:
        if (self.spread is None) != (self.sigmas is None):
            raise ValueError(f"rule {self.name}: spread and sigmas go together")
        if self.op not in _OPS:
            raise ValueError(f"rule {self.name}: op must be one of {', '.join(_OPS)}")
        if self.op == "<" and self.spread is not None:
            raise ValueError(f"rule {self.name}: a '<' rule takes no spread")
        if self.spread_signal is not None and self.spread is None:
            raise ValueError(f"rule {self.name}: spread_signal needs a spread")

    def settings(self) -> tuple[str, ...]:
        """The EngineConfig settings the rule reads."""
        named = (self.margin, self.sigmas, self.factor, *self.less)
        return tuple(s for s in named if s is not None)


_OPS = (">=", ">", "<")


def evaluate(
    rules: Iterable[Rule],
    arrays: Mapping[str, np.ndarray],
    config: object,
    scales: np.ndarray | float = 1.0,
) -> dict[str, np.ndarray]:
    """Each rule's truth per subject. With `scales` of shape (k, 1) every result has shape (k, n): the
    same rules at k multiples of their floors in one pass (the weaker multiples keep an open alert from
    clearing and hold job-level alerts back). A disabled rule is all False."""
    disabled: frozenset[str] = getattr(config, "disabled_rules", frozenset())
    scale = np.asarray(scales, dtype=float)
    # A plain number keeps every threshold a Python float: numpy's 0-d arithmetic and broadcasting cost
    # more per rule than the comparisons themselves, and give the same values.
    scale_of: np.ndarray | float = float(scale) if scale.ndim == 0 else scale
    out: dict[str, np.ndarray] = {}
    shapes: dict[tuple[int, ...], tuple[int, ...]] = {}  # signal's shape -> the results' (np.broadcast_shapes is slow)
    for rule in rules:
        signal = np.asarray(arrays[rule.signal], dtype=float)
        shape = signal.shape
        if scale.ndim:
            if shape not in shapes:
                shapes[shape] = np.broadcast_shapes(scale.shape, shape)
            shape = shapes[shape]
        if rule.name in disabled:
            out[rule.name] = np.zeros(shape, dtype=bool)
            continue
        holds = _holds(rule, signal, arrays, config, scale_of)
        out[rule.name] = holds if holds.shape == shape else np.broadcast_to(holds, shape)
    return out


def _holds(
    rule: Rule, signal: np.ndarray, arrays: Mapping[str, np.ndarray], config: object, scale: np.ndarray | float
) -> np.ndarray:
    """One enabled rule's truth, in the shape its operands broadcast to."""
    floor = float(getattr(config, rule.margin)) if rule.margin is not None else 0.0
    threshold = (scale if rule.scaled else 1.0) * floor
    if rule.factor is not None:
        threshold = threshold * float(getattr(config, rule.factor))
    for setting in rule.less:
        threshold = threshold - float(getattr(config, setting))
    if rule.reference is not None:
        threshold = np.asarray(arrays[rule.reference], dtype=float) + threshold
    noisy = None
    if rule.spread is not None:
        assert rule.sigmas is not None  # __post_init__
        widened = float(getattr(config, rule.sigmas)) * np.asarray(arrays[rule.spread], dtype=float)
        if rule.scale_spread and rule.scaled:
            widened = scale * widened
        if rule.spread_signal is None:
            threshold = np.fmax(threshold, widened)  # fmax: a NaN spread leaves the floor
        else:
            noisy = np.asarray(arrays[rule.spread_signal], dtype=float) < widened
    if rule.op == ">=":
        holds = signal >= threshold
    elif rule.op == ">":
        holds = signal > threshold
    else:
        holds = signal < threshold
    if noisy is not None:
        holds = holds & ~noisy
    for gate in rule.gates:
        holds = holds & arrays[gate]
    for gate in rule.unless:
        holds = holds & ~arrays[gate]
    return np.asarray(holds)


def any_of(results: Mapping[str, np.ndarray], names: Sequence[str]) -> np.ndarray:
    """Whether any of the named rules holds (they share one shape)."""
    it = iter(names)
    acc = np.array(results[next(it)], dtype=bool)
    for name in it:
        acc = acc | results[name]
    return acc


def names(*rule_sets: Iterable[Rule]) -> frozenset[str]:
    """Every rule name in the given declarations; a name used twice is a mistake."""
    seen: list[str] = [r.name for rules in rule_sets for r in rules]
    dupes = {n for n in seen if seen.count(n) > 1}
    if dupes:
        raise ValueError(f"rule names declared twice: {sorted(dupes)}")
    return frozenset(seen)
