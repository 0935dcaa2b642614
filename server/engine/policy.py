"""The detection policy as data: every rule the standard detectors declare, for the evaluation's ablation
table and the reference docs."""

from __future__ import annotations

from gpufleet.server.engine.registry import STANDARD, declared_rules as _declared
from gpufleet.server.engine.rules import Rule, names


def declared_rules() -> dict[str, tuple[Rule, ...]]:
    """Detector name -> its rules, in declaration order."""
    return _declared(STANDARD)


def rule_names() -> frozenset[str]:
    """Every declared rule name (a name declared twice raises ValueError)."""
    return names(*declared_rules().values())
