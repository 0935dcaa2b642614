"""The alert vocabulary: the short cause each alert carries as a label."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpufleet.server.alerts import AlertKind, cause
from tests.server.live_fakes import make_alert


@pytest.mark.parametrize(
    "kind,evidence,expected",
    [
        (
            AlertKind.STRAGGLER,
            {"pattern": "gpu_clocks_cut", "throttle_causes": ["hw_slowdown_or_power_brake"]},
            "gpu_clocks_cut+hw_slowdown_or_power_brake",
        ),
        (
            AlertKind.STRAGGLER,
            {"pattern": "node_clocks_cut", "throttle_causes": ["hw_thermal_slowdown", "sw_power_cap"]},
            "node_clocks_cut+hw_thermal_slowdown+sw_power_cap",
        ),
        (AlertKind.STRAGGLER, {"pattern": "host_idle", "throttle_causes": []}, "host_idle"),
        (AlertKind.STRAGGLER, {"pattern": "gpu_slow"}, "gpu_slow"),
        (
            AlertKind.THERMAL_THROTTLE,
            {
                "temperature_celsius": 87.0,
                "threshold_celsius": 83.0,
                "memory_at_limit": False,
                "throttle_reasons": ["hw_thermal_slowdown"],
            },
            "temperature+hw_thermal_slowdown",
        ),
        (
            AlertKind.THERMAL_THROTTLE,
            {"temperature_celsius": 71.0, "threshold_celsius": 83.0, "memory_at_limit": True, "throttle_reasons": []},
            "hbm_temperature",
        ),
        (
            AlertKind.THERMAL_THROTTLE,
            {
                "temperature_celsius": None,
                "threshold_celsius": 83.0,
                "memory_at_limit": False,
                "throttle_reasons": ["sw_thermal_slowdown"],
            },
            "sw_thermal_slowdown",
        ),
        (AlertKind.XID, {"code": 79, "meaning": "GPU has fallen off the bus"}, "xid_79"),
        (AlertKind.XID, {"code": None, "meaning": "XID code not reported"}, ""),
        (AlertKind.COMM_BOUND, {"signal": "sm_active_ratio", "drop_ratio": 0.25}, ""),
        (AlertKind.NODE_UNREACHABLE, {"silent_seconds": 40.0}, ""),
    ],
)
def test_each_alert_says_its_cause_in_a_few_fixed_words(kind, evidence, expected):
    assert cause(replace(make_alert(1, kind=kind), evidence=evidence)) == expected
