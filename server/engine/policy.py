"""The detection policy as data: every rule the detectors declare, for the engine's check of
EngineConfig.disabled_rules, the evaluation's ablation table and the reference docs."""

from __future__ import annotations

from gpufleet.server.engine.detectors import health, straggler, thermal, workload
from gpufleet.server.engine.rules import Rule, names

DETECTORS = {"thermal": thermal, "straggler": straggler, "workload": workload, "health": health}


def declared_rules() -> dict[str, tuple[Rule, ...]]:
    """Detector name -> its rules, in declaration order."""
    return {name: module.RULES for name, module in DETECTORS.items()}


def rule_names() -> frozenset[str]:
    """Every declared rule name (a name declared twice raises ValueError)."""
    return names(*declared_rules().values())
