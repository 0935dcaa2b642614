"""EngineConfig.from_mapping: names the bad key or value."""

from __future__ import annotations

import pytest

from gpufleet.server.engine import EngineConfig


def test_defaults_and_overrides():
    cfg = EngineConfig.from_mapping(
        {"thermal_temperature_celsius": 80, "thermal-for-seconds": 20.0, "straggler_min_group": 4}
    )
    assert cfg.thermal_temperature_celsius == 80.0 and cfg.thermal_for_seconds == 20.0
    assert cfg.straggler_min_group == 4 and cfg.tick_seconds == 5.0


@pytest.mark.parametrize(
    "data, match",
    [
        ({"no_such_key": 1}, "no_such_key"),
        ({"tick_seconds": "5"}, "tick_seconds"),
        ({"tick_seconds": True}, "tick_seconds"),
        ({"straggler_min_group": 2.5}, "integer"),
        ({"tick_seconds": 0}, "tick_seconds"),
        ({"smooth_seconds": 1.0}, "smooth_seconds"),
        ({"unreachable_seconds": -1}, "unreachable_seconds|window_seconds"),
        ([1, 2], "mapping"),
    ],
)
def test_bad_config_is_a_value_error_naming_it(data, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_mapping(data)
