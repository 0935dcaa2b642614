"""Severity from cost: a lost GPU or data at risk is critical whatever it costs; anything else is critical
only where its job loses critical_loss_gpu_hours_per_hour or more."""

from __future__ import annotations

from gpufleet.server.alerts import AlertKind, Severity
from gpufleet.server.engine import EngineConfig
from gpufleet.server.engine.detectors import Finding
from gpufleet.server.engine.severity import graded, loss_rate

CONFIG = EngineConfig()


def _straggler(gpus: int, slowdown: float) -> Finding:
    """A straggler's finding as its detector makes it: a warning, costing gpus x slowdown for one tick."""
    cost = gpus * slowdown * CONFIG.tick_seconds / 3600.0
    return Finding(AlertKind.STRAGGLER, "dgx-03", 2, None, "71002", Severity.WARNING, "", cost_gpu_hours=cost)


def test_a_20_percent_straggler_in_16_gpus_is_a_warning_and_in_64_gpus_critical() -> None:
    assert abs(loss_rate(_straggler(16, 0.2), CONFIG) - 3.2) < 1e-9
    assert graded(_straggler(16, 0.2), CONFIG) is Severity.WARNING
    assert graded(_straggler(64, 0.2), CONFIG) is Severity.CRITICAL
    assert graded(_straggler(16, 0.2), EngineConfig(critical_loss_gpu_hours_per_hour=3.0)) is Severity.CRITICAL


def test_a_lost_gpu_is_critical_at_no_cost_and_an_unknown_cost_is_no_loss() -> None:
    lost = Finding(AlertKind.GPU_LOST, "node-a", 6, None, None, Severity.CRITICAL, "")
    assert graded(lost, CONFIG) is Severity.CRITICAL
    assert graded(_straggler(16, float("nan")), CONFIG) is Severity.WARNING
