"""thermal_throttle through the engine: sustained heat fires, spikes do not, hysteresis resolves."""

from __future__ import annotations

from gpufleet.server.replay import run_replay
from tests.server.engine_samples import T0, cluster_lines


def _alerts(override, seconds=900.0, interval=5.0):
    return [
        a for a in run_replay(cluster_lines(seconds, interval, override=override)) if a.kind.value == "thermal_throttle"
    ]


def test_sustained_heat_fires_after_for_duration_and_resolves_with_hysteresis():
    def hot(t, node, gpu):
        if node == "n1" and gpu == 4:
            if 300 <= t < 600:
                return {"temperature_celsius": 84.5}
            if 600 <= t < 700:
                return {"temperature_celsius": 81.0}  # below threshold but inside the hysteresis band
        return {}

    (a,) = _alerts(hot)
    assert (a.node, a.gpu, a.severity.value) == ("n1", 4, "warning")
    assert T0 + 330 <= a.started <= T0 + 345
    assert a.resolved is not None and a.resolved >= T0 + 700 + 30
    assert a.evidence["temperature_celsius"] == 84.5


def test_short_spike_is_not_an_alert():
    def spike(t, node, gpu):
        return {"temperature_celsius": 86.0} if node == "n0" and gpu == 1 and 300 <= t < 315 else {}

    assert _alerts(spike) == []


def test_hw_thermal_bits_fire_below_threshold_as_a_warning():
    """Clocks cut by heat cost what the straggler they make says; the GPU is not at its own limits."""

    def bits(t, node, gpu):
        if node == "n0" and gpu == 2 and t >= 300:
            return {"throttle_reasons": 0x40, "temperature_celsius": 80.0, "sm_clock_hertz": 1.2e9}
        return {}

    (a,) = _alerts(bits)
    assert a.severity.value == "warning" and a.resolved is None
    assert a.evidence["clocks_cut"] is True


def test_near_own_slowdown_temperature_is_critical():
    def near(t, node, gpu):
        return {"temperature_celsius": 86.0} if node == "n0" and gpu == 0 and t >= 300 else {}

    (a,) = _alerts(near)
    assert a.severity.value == "critical" and a.evidence["near_slowdown_limit"] is True


def test_one_second_sampling_fires_the_same_alert():
    def hot(t, node, gpu):
        return {"temperature_celsius": 84.0} if node == "n1" and gpu == 0 and t >= 300 else {}

    (a,) = _alerts(hot, seconds=500.0, interval=1.0)
    assert T0 + 330 <= a.started <= T0 + 340


def test_hbm_at_its_own_limit_fires_critical_with_a_cool_die_and_resolves_with_hysteresis():
    def hbm(t, node, gpu):
        base = {"memory_temperature_celsius": 70.0, "memory_max_operating_temperature_celsius": 95.0}
        if node == "n0" and gpu == 3:
            if 300 <= t < 600:
                base["memory_temperature_celsius"] = 95.0
            elif 600 <= t < 700:
                base["memory_temperature_celsius"] = 93.0  # under its limit, inside the hysteresis band
        return base

    (a,) = _alerts(hbm)
    assert (a.node, a.gpu, a.severity.value) == ("n0", 3, "critical")
    assert T0 + 330 <= a.started <= T0 + 345
    assert a.resolved is not None and a.resolved >= T0 + 700 + 30
    assert a.evidence["temperature_celsius"] == 60.0
    assert a.evidence["memory_temperature_celsius"] == 95.0
    assert a.evidence["memory_max_operating_temperature_celsius"] == 95.0
    assert a.evidence["memory_at_limit"] is True
    assert "HBM 95 °C" in a.summary


def test_hbm_without_a_reported_limit_is_never_a_trigger():
    def hbm(t, node, gpu):
        return {"memory_temperature_celsius": 99.0} if node == "n0" and gpu == 3 and t >= 300 else {}

    assert _alerts(hbm) == []


def test_a_hot_die_alert_carries_the_hbm_reading_and_absent_stays_absent():
    def hot(t, node, gpu):
        if node == "n1" and t >= 300 and gpu in (4, 5):
            extra = {"memory_temperature_celsius": 88.0, "memory_max_operating_temperature_celsius": 95.0}
            return {"temperature_celsius": 84.5, **(extra if gpu == 4 else {})}
        return {}

    with_hbm, without = sorted(_alerts(hot), key=lambda a: a.gpu)
    assert with_hbm.severity.value == "warning" and with_hbm.evidence["memory_at_limit"] is False
    assert with_hbm.evidence["memory_temperature_celsius"] == 88.0 and "HBM" not in with_hbm.summary
    assert without.evidence["memory_temperature_celsius"] is None
    assert without.evidence["memory_max_operating_temperature_celsius"] is None
