"""The simulated physics: phases, heat, throttling and counters, as pure functions of scenario time."""

from __future__ import annotations

import statistics

import pytest

from gpufleet.agent.sim import load_scenario, parse_scenario
from gpufleet.agent.sim import physics as ph
from gpufleet.agent.sim.hardware import A100_SXM4, H100_SXM
from gpufleet.agent.sim.physics import Thermal, Timeline, build_world, related_gpus, step, thermal_clock


def _timeline(scenario: str, node: str, seed: int = 0) -> Timeline:
    return Timeline(build_world(load_scenario(scenario), node, seed))


def _avg(tl: Timeline, index: int, slot: int, t0: float, t1: float) -> float:
    return tl.mean(index, t0, t1)[slot]


@pytest.fixture(scope="module")
def demo01() -> Timeline:
    return _timeline("demo", "dgx-01")


@pytest.fixture(scope="module")
def demo02() -> Timeline:
    return _timeline("demo", "dgx-02")


@pytest.fixture(scope="module")
def demo03() -> Timeline:
    return _timeline("demo", "dgx-03")


def test_query_order_does_not_matter():
    forward = _timeline("demo", "dgx-02")
    backward = _timeline("demo", "dgx-02")
    times = [3.5, 61.2, 150.0, 201.7, 299.9]
    a = [(forward.state(5, t), forward.integral(5, t), forward.temperature(5, t)) for t in times]
    b = [(backward.state(5, t), backward.integral(5, t), backward.temperature(5, t)) for t in reversed(times)]
    assert a == list(reversed(b))


def test_rewinding_past_the_window_recomputes_identically(monkeypatch):
    monkeypatch.setattr(ph, "WINDOW_BUCKETS", 20)
    monkeypatch.setattr(ph, "CHECKPOINT_EVERY", 50)
    tl = _timeline("hgx-h100", "hgx-h100-01")
    early = tl.integral(3, 70.25)
    tl.integral(3, 400.0)
    assert tl.integral(3, 70.25) == early


def test_seed_changes_noise_not_structure():
    a = _timeline("hgx-h100", "hgx-h100-01", seed=0)
    b = _timeline("hgx-h100", "hgx-h100-01", seed=1)
    assert a.state(0, 200).rates != b.state(0, 200).rates
    assert a.state(0, 200).job == b.state(0, 200).job == "70001"


def test_related_gpus_follow_jobs_across_nodes():
    demo = load_scenario("demo")
    refs = related_gpus(demo, "dgx-01")
    assert {n for n, _ in refs} == {"dgx-01", "dgx-02"}
    assert len(refs) == 16


def test_nodes_agree_on_shared_job_state():
    """dgx-01's world and dgx-02's world compute identical states for every GPU of job 71001."""
    demo = load_scenario("demo")
    w1, w2 = build_world(demo, "dgx-01", 7), build_world(demo, "dgx-02", 7)
    th1, th2 = ph.initial_thermal(w1), ph.initial_thermal(w2)
    for k in range(0, 260):
        s1, th1 = step(w1, k, th1)
        s2, th2 = step(w2, k, th2)
    for ref, p1 in w1.position.items():
        assert s1[p1] == s2[w2.position[ref]]


def test_sw_thermal_band():
    slowdown = H100_SXM.slowdown_celsius
    assert thermal_clock(H100_SXM, 70.0) == (1.0, 0)
    ratio, bits = thermal_clock(H100_SXM, slowdown - 1.0)
    assert bits == ph.SW_THERMAL and 0.9 < ratio < 1.0
    assert thermal_clock(H100_SXM, slowdown + 3.0) == (1.0 - ph.SW_THERMAL_MAX_CUT, ph.SW_THERMAL)


def test_hw_thermal_slowdown_takes_the_share_that_holds_the_die_at_its_threshold():
    world = build_world(load_scenario("demo"), "dgx-02", 0)
    g = world.gpus[world.position[("dgx-02", 5)]]
    slowdown, inlet, factor = H100_SXM.slowdown_celsius, 30.0, 2.6
    run_w, hw_w = 560.0, 240.0
    assert ph.hw_thermal_duty(g, Thermal(80.0, 60.0), inlet, 1.0, run_w, hw_w) == 0.0
    hot = Thermal(slowdown, slowdown - 20.0)
    duty = ph.hw_thermal_duty(g, hot, inlet, factor, run_w, hw_w)
    assert 0.0 < duty < 1.0
    # At the share's mean power the die ends the second at the threshold.
    mean_w = run_w + duty * (hw_w - run_w)
    sink = inlet + H100_SXM.sink_resistance_c_per_w * factor * mean_w
    die = H100_SXM.die_resistance_c_per_w * factor * mean_w
    end = sink + (hot.sink_c - sink) * g.sink_decay + die + (hot.temp_c - hot.sink_c - die) * g.die_decay
    assert end == pytest.approx(slowdown, abs=1e-6)
    # Cooling so poor that even the HW clock heats the die: the whole second at it.
    assert ph.hw_thermal_duty(g, hot, inlet, 6.0, run_w, hw_w) == 1.0


def test_temperature_follows_power_in_two_stages():
    """A full load from idle: the die's own rise over the heatsink within a second or two, the heatsink's
    first-order rise over minutes (about 63 % of the way after its time constant), and the sum of both
    rises per watt once settled."""
    scenario = parse_scenario(
        {
            "name": "step",
            "duration_s": 1200,
            "ambient_c": 25,
            "nodes": [{"name": "n", "model": "h100-sxm", "gpus": 1}],
            "jobs": [{"id": "j", "nodes": ["n"], "start_s": 100, "ramp_up_s": 0}],
        }
    )
    tl = Timeline(build_world(scenario, "n", 0))
    idle, busy = _avg(tl, 0, ph.POWER_W, 50, 100), _avg(tl, 0, ph.POWER_W, 100, 1100)
    before, fast, settled = tl.temperature(0, 100.0), tl.temperature(0, 102.0), tl.temperature(0, 1100.0)
    assert fast - before == pytest.approx(H100_SXM.die_resistance_c_per_w * (busy - idle), rel=0.15)
    one_tau = tl.temperature(0, 102.0 + H100_SXM.sink_tau_s)
    assert 0.5 < (one_tau - fast) / (settled - fast) < 0.75
    rise_per_w = H100_SXM.die_resistance_c_per_w + H100_SXM.sink_resistance_c_per_w
    assert settled - before == pytest.approx(rise_per_w * (busy - idle), rel=0.1)
    assert abs(tl.temperature(0, 1100.0) - tl.temperature(0, 1099.0)) < 0.2
    hgx = _timeline("hgx-h100", "hgx-h100-01")
    assert 55.0 < hgx.temperature(0, 600.0) < 80.0


def test_idle_gpu_reads_idle():
    tl = _timeline("cluster-incidents", "node-c")
    state = tl.state(6, 400.0)  # GPU 6 of node-c runs no job
    assert state.job is None and state.reasons & ph.IDLE
    assert state.rates[ph.UTIL] == 0.0
    assert state.rates[ph.POWER_W] == pytest.approx(A100_SXM4.idle_watts, rel=0.06)


def test_startup_is_low_and_irregular():
    tl = _timeline("hgx-h100", "hgx-h100-01")
    utils = [tl.state(0, t).rates[ph.UTIL] for t in range(5, 55)]
    assert max(utils) < 0.5 and statistics.pstdev(utils) > 0.03
    assert tl.state(0, 10).memory_used_bytes < tl.state(0, 200).memory_used_bytes


def test_structural_offsets_are_there_all_along():
    tl = _timeline("hgx-h100", "hgx-h100-01")
    temps = [tl.temperature(i, 500.0) for i in range(8)]
    powers = [_avg(tl, i, ph.POWER_W, 400, 500) for i in range(8)]
    assert max(temps) - min(temps) > 1.0
    assert max(temps) - min(temps) < 12.0
    assert max(powers) / min(powers) < 1.08
    utils = [_avg(tl, i, ph.UTIL, 400, 500) for i in range(8)]
    assert min(utils) > 0.98


def test_cooling_failure_throttles_and_holds_the_job_back(demo01, demo02):
    hot = [demo02.temperature(5, t) for t in range(280, 360, 5)]
    assert min(hot) > 83.0
    bits = 0
    for t in range(230, 360):
        bits |= demo02.state(5, t).reasons
    assert bits & ph.HW_THERMAL and bits & ph.SW_THERMAL
    sm_clock = _avg(demo02, 5, ph.SM_CLOCK_MHZ, 280, 350)
    assert sm_clock < 0.9 * H100_SXM.sm_clock_max_mhz
    # Peers on the other node wait for it: lower SM activity and power, utilization stays high.
    before = _avg(demo01, 0, ph.SM, 80, 115), _avg(demo01, 0, ph.POWER_W, 80, 115)
    during = _avg(demo01, 0, ph.SM, 260, 350), _avg(demo01, 0, ph.POWER_W, 260, 350)
    assert during[0] < 0.85 * before[0] and during[1] < 0.9 * before[1]
    assert _avg(demo01, 0, ph.UTIL, 260, 350) > 0.98
    # The straggler itself stays busy.
    assert _avg(demo02, 5, ph.SM, 260, 350) > 1.3 * during[0]
    # After the incident it cools and the job recovers.
    assert demo02.temperature(5, 480.0) < 75.0
    assert _avg(demo01, 0, ph.SM, 460, 510) > 0.95 * before[0]


def test_silent_slow_gpu_has_no_bits(demo03):
    reasons = {demo03.state(2, t).reasons for t in range(230, 360, 7)}
    assert reasons == {0}
    peer_sm = _avg(demo03, 0, ph.SM, 240, 350)
    assert _avg(demo03, 2, ph.SM, 240, 350) > 1.2 * peer_sm
    assert _avg(demo03, 2, ph.SM_CLOCK_MHZ, 240, 350) == pytest.approx(H100_SXM.sm_clock_max_mhz)


def test_comm_slowdown_lowers_sm_job_wide_with_utilization_high(demo03):
    before = [_avg(demo03, i, ph.SM, 440, 475) for i in range(8)]
    during = [_avg(demo03, i, ph.SM, 500, 590) for i in range(8)]
    assert all(d < 0.8 * b for b, d in zip(before, during))
    assert max(during) - min(during) < 0.05  # nobody stands out
    assert min(_avg(demo03, i, ph.UTIL, 500, 590) for i in range(8)) > 0.98
    assert _avg(demo03, 0, ph.NVLINK_TX_KIB, 500, 590) < _avg(demo03, 0, ph.NVLINK_TX_KIB, 440, 475)


def test_input_wait_vs_collective_wait():
    starved = _timeline("cluster-incidents", "node-b")
    peer = _timeline("cluster-incidents", "node-a")
    # node-b starves its GPUs (300-400 s): their utilization itself falls.
    assert _avg(starved, 0, ph.UTIL, 310, 390) < 0.7
    # node-a's GPUs spin in the collective waiting for node-b: utilization high, SM activity low.
    assert _avg(peer, 0, ph.UTIL, 310, 390) > 0.98
    assert _avg(peer, 0, ph.SM, 310, 390) < 0.7 * _avg(peer, 0, ph.SM, 260, 295)


def test_power_brake_slow_gpu_sets_bits_and_cuts_clock():
    tl = _timeline("cluster-incidents", "node-b")
    state = tl.state(3, 150.0)
    assert state.reasons & ph.HW_POWER_BRAKE and state.reasons & ph.HW_SLOWDOWN
    assert state.rates[ph.SM_CLOCK_MHZ] == pytest.approx(0.7 * H100_SXM.sm_clock_max_mhz)


def test_power_cap_is_uniform_and_respected():
    tl = _timeline("cluster-incidents", "node-a")
    clocks = {round(tl.state(i, 600.0).rates[ph.SM_CLOCK_MHZ]) for i in range(0, 7)}
    assert len(clocks) == 1 and clocks.pop() < H100_SXM.sm_clock_max_mhz
    for i in range(7):
        state = tl.state(i, 600.0)
        assert state.reasons & ph.SW_POWER_CAP
        assert state.rates[ph.POWER_W] <= 450.0


def _single_job(intensity: float, cap_watts: float | None = None) -> Timeline:
    doc = {
        "name": "one",
        "duration_s": 400,
        "nodes": [{"name": "n", "model": "h100-sxm", "gpus": 2}],
        "jobs": [{"id": "j", "nodes": ["n"], "ramp_up_s": 0, "compute_fraction": 0.9, "compute_intensity": intensity}],
    }
    if cap_watts is not None:
        doc["incidents"] = [{"kind": "power_cap", "job": "j", "start_s": 200, "watts": cap_watts}]
    return Timeline(build_world(parse_scenario(doc), "n", 0))


def test_training_wants_less_than_the_board_limit_and_runs_uncapped():
    tl = _timeline("hgx-h100", "hgx-h100-01")
    for t in range(100, 300, 10):
        for i in range(8):
            state = tl.state(i, t)
            assert not state.reasons & ph.SW_POWER_CAP
            assert state.rates[ph.SM_CLOCK_MHZ] == H100_SXM.sm_clock_max_mhz
            assert state.rates[ph.POWER_W] < 0.9 * H100_SXM.tdp_watts
    assert tl.integral(0, 300.0)[ph.NS_SW_POWER_CAP] == 0.0


def test_a_load_wanting_more_than_the_board_limit_is_held_at_it():
    tl = _single_job(1.43)
    clocks = {tl.state(i, t).rates[ph.SM_CLOCK_MHZ] for i in range(2) for t in range(20, 200, 7)}
    assert len(clocks) == 1 and 0.75 * H100_SXM.sm_clock_max_mhz < clocks.pop() < 0.9 * H100_SXM.sm_clock_max_mhz
    powers = [tl.state(0, t).rates[ph.POWER_W] for t in range(20, 200)]
    assert all(0.95 * H100_SXM.tdp_watts <= p <= H100_SXM.tdp_watts for p in powers)
    assert all(tl.state(0, t).reasons == ph.SW_POWER_CAP for t in range(20, 200))
    # The driver's power-cap time counter: a second per second while capped, in nanoseconds.
    assert tl.integral(0, 150.0)[ph.NS_SW_POWER_CAP] - tl.integral(0, 50.0)[ph.NS_SW_POWER_CAP] == pytest.approx(1e11)


def test_one_governor_for_the_board_limit_and_an_operator_cap():
    """An operator cap above the board limit changes nothing; one below it lowers the clock further."""
    above, below = _single_job(1.43, cap_watts=800.0), _single_job(1.43, cap_watts=450.0)
    assert above.state(0, 300).rates == _single_job(1.43).state(0, 300).rates
    assert below.state(0, 300).reasons & ph.SW_POWER_CAP
    assert below.state(0, 300).rates[ph.POWER_W] <= 450.0
    assert below.state(0, 300).rates[ph.SM_CLOCK_MHZ] < above.state(0, 300).rates[ph.SM_CLOCK_MHZ]


def test_counters_integrate_rates():
    tl = _timeline("hgx-h100", "hgx-h100-01")
    energy = tl.integral(2, 300.0)[ph.POWER_W] - tl.integral(2, 200.0)[ph.POWER_W]
    assert energy == pytest.approx(100.0 * _avg(tl, 2, ph.POWER_W, 200.0, 300.0))
    a, b = tl.integral(2, 250.0), tl.integral(2, 250.5)
    assert all(y >= x for x, y in zip(a, b))


def test_counter_reset_base():
    tl = _timeline("cluster-incidents", "node-a")
    assert tl.counter_base(0, 699.0) == (0.0,) * ph.N_RATES
    base = tl.counter_base(0, 710.0)
    assert base[ph.POWER_W] == pytest.approx(tl.integral(0, 700.0)[ph.POWER_W])


def test_lost_gpu_hangs_its_job():
    tl = _timeline("cluster-incidents", "node-b")  # node-a GPU 7 falls off the bus at 750 s
    assert _avg(tl, 0, ph.UTIL, 760, 790) > 0.98
    assert _avg(tl, 0, ph.SM, 760, 790) < 0.1
