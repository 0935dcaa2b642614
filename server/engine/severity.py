"""How grave an alert is: what it costs, not how far a reading is off.

Critical where a GPU is lost or its data is at risk (the detector says so: Finding.severity is critical
for a lost GPU, a silent node, uncorrected ECC errors, an XID that means one of these, a GPU at its own
temperature limits), or where a job loses at least `critical_loss_gpu_hours_per_hour`: the GPUs the
problem slows times how much it slows them (a costing kind's Finding.cost_gpu_hours, as a rate).
Warning otherwise: a 20 % straggler in a 16-GPU job costs 3.2 GPU-hours per hour, a lost GPU the job.
"""

from __future__ import annotations

from typing import Mapping

from gpufleet.server.alerts import AlertKind, Severity
from gpufleet.server.engine.config import EngineConfig
from gpufleet.server.engine.detectors import Finding, Outcome
from gpufleet.server.engine.units import SECONDS_PER_HOUR


def loss_rate(finding: Finding, config: EngineConfig) -> float:
    """GPU-hours per hour the finding costs its job at this tick (0 where unknown)."""
    rate = finding.cost_gpu_hours * SECONDS_PER_HOUR / config.tick_seconds
    return rate if rate == rate else 0.0


def graded(finding: Finding, config: EngineConfig) -> Severity:
    """Critical for a lost GPU or data at risk, or a costly loss; warning otherwise."""
    if finding.severity is Severity.CRITICAL:
        return Severity.CRITICAL
    if loss_rate(finding, config) >= config.critical_loss_gpu_hours_per_hour:
        return Severity.CRITICAL
    return Severity.WARNING


def grade(outcomes: Mapping[AlertKind, Outcome], config: EngineConfig) -> None:
    """Set every finding's severity by graded()."""
    for outcome in outcomes.values():
        for finding in outcome.findings.values():
            finding.severity = graded(finding, config)
